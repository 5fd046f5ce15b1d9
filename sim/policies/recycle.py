"""ReCycle-like policy: a failed worker's micro-batches are rerouted to its data-parallel
peers and squeezed into their pipeline bubbles.

Model of ReCycle (Gandhi et al., SOSP'24, "ReCycle: Resilient Training of Large DNNs
using Pipeline Adaptation", arXiv:2405.14009):

- Granularity is the worker (a stage's TP group): a failed device takes out its stage in
  its replica. The other stages of that replica keep working; the failed stage's
  micro-batches are processed by the same stage of the other replicas (functional
  redundancy), spread as evenly as whole micro-batches allow over the survivors.
- Adaptive pipelining + decoupled backprop (B now, W later) + a staggered optimizer place
  the rerouted work in the peers' pipeline bubbles. The model is deliberately generous:
  rerouted work costs nothing until it exceeds the whole bubble of that stage
  (T_pipe − m·c_s); only the excess lengthens the iteration:
  ``T = T_pipe + max_s max(0, extra_s − bubble_s) + dp_sync``.
- Reconfiguration needs no state movement (the schedules are precomputed by its
  planner): detection + regroup; only the in-flight iteration is lost. A repaired node
  rejoins (regroup + copying its stage's state from a peer).
- If every replica of some stage has failed there is no peer left: the job stops and
  restarts from the last checkpoint once hardware is back.
- Fail-slows are not handled (fail-stop only).
"""
from __future__ import annotations

import math

from resihp.sim.engine import Phase, Reaction
from resihp.sim.perf import JobSpec, PerfModel, StageCost
from resihp.sim.policies.base import Policy, Settings
from resihp.sim.world import FailStop, World, WorldEvent


class ReCycle(Policy):
    name = "recycle"
    source = "Gandhi et al., ReCycle, SOSP'24 (arXiv:2405.14009): reroute to DP peers into bubbles, fail-stop only"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings)
        self.crashed = False

    def _failed_positions(self) -> set[tuple[int, int]]:
        out = set()
        for r in self.world.dead_ranks():
            if self.plan.has_rank(r):
                pos = self.plan.position(r)
                out.add((pos.replica, pos.stage))
        return out

    def rate_now(self) -> float:
        if self.crashed:
            return 0.0
        failed = self._failed_positions()
        if not failed:
            return self.rate()
        plan, dp = self.plan, self.plan.dp
        healed = World(self.world.world_size, self.world.gpus_per_node, {}, dict(self.world.slow), dict(self.world.net))
        costs = [self.perf.replica_stage_costs(plan, i, healed) for i in range(dp)]
        pp = plan.replicas[0].pp
        k = [sum(1 for i in range(dp) if (i, s) in failed) for s in range(pp)]
        if any(x >= dp for x in k):
            return 0.0
        # a failed stage's cost in its replica's pipeline: the surviving peers' worst
        peer_c = []
        for s in range(pp):
            alive = [costs[i][s].f_s + costs[i][s].b_s for i in range(dp) if (i, s) not in failed]
            peer_c.append(max(alive))
        pipe = 0.0
        for i, rep in enumerate(plan.replicas):
            cs = [
                StageCost(costs[i][s].f_s, costs[i][s].b_s) if (i, s) not in failed
                else StageCost(peer_c[s] * 0.5, peer_c[s] * 0.5)  # only f+b matters for 1F1B
                for s in range(pp)
            ]
            pipe = max(pipe, self.perf.pipeline_s(cs, rep.microbatches))
        excess = 0.0
        for s in range(pp):
            if not k[s]:
                continue
            rerouted = sum(plan.replicas[i].microbatches for i in range(dp) if (i, s) in failed)
            extra = math.ceil(rerouted / (dp - k[s])) * peer_c[s]  # whole micro-batches: the busiest peer
            bubble = min(
                pipe - plan.replicas[i].microbatches * (costs[i][s].f_s + costs[i][s].b_s)
                for i in range(dp) if (i, s) not in failed
            )
            excess = max(excess, extra - max(0.0, bubble))
        t = pipe + excess + self.perf.dp_sync_s(plan, healed)
        return plan.global_microbatches * self.job.tokens_per_microbatch / t if t > 0 and math.isfinite(t) else 0.0

    def steady(self, note: str = "", **kw: object) -> Reaction:
        tps = self.rate_now()
        return Reaction(steady_tps=tps, steady_label=self.label_for(tps), note=note, **kw)  # type: ignore[arg-type]

    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        if not isinstance(ev.fault, FailStop):
            return self.steady()
        if ev.start:
            touched = any(self.plan.has_rank(r) for r in ev.fault.ranks)
            if not touched or self.crashed:
                return self.steady()
            if self.rate_now() <= 0.0:
                lost = self.rollback_tokens(now)
                self.crashed = True
                return Reaction(0.0, "down", keep_phases=False, lost_tokens=lost,
                                note=f"{ev.label}: a stage lost every replica; waiting for repair", restarts=0)
            lost = self.inflight_tokens(now)
            tps = self.rate_now()
            phases = (Phase(self.detect_stop_s(ev.fault), 0.0, "down"), Phase(self.settings.regroup_s, 0.0, "reconfig"))
            return Reaction(tps, self.label_for(tps), phases, keep_phases=False, lost_tokens=lost, reconfigurations=1,
                            note=f"{ev.label}: reroute to DP peers ({len(self._failed_positions())} workers out)")
        # repair
        if self.crashed:
            self.crashed = False
            if self.rate_now() <= 0.0:
                self.crashed = True
                return Reaction(0.0, "down")
            self.run_start = now + self.settings.restart_s
            tps = self.rate_now()
            return Reaction(tps, self.label_for(tps), (Phase(self.settings.restart_s, 0.0, "restart"),),
                            keep_phases=False, restarts=1, note=f"{ev.label}: restart from checkpoint")
        if not any(self.plan.has_rank(r) for r in ev.fault.ranks):
            return self.steady()
        layers = max(self.plan.replicas[0].layers)
        copy_s = layers * self.job.model.params_per_layer() * self.perf.memory.moved_bytes_per_param / self.job.tp
        pause = self.settings.regroup_s + copy_s / self.job.inter_node_bw_Bps
        tps = self.rate_now()
        return Reaction(tps, self.label_for(tps), (Phase(pause, 0.0, "reconfig"),), reconfigurations=1,
                        note=f"{ev.label}: worker rejoins")
