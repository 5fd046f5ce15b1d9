"""Restart-based policies: static, checkpoint-restart without and with a spare node.

- ``static``: no adaptation at all. A fail-slow sets the pace of the whole job; a fail-stop
  crashes it, and it is relaunched in the same shape once the hardware is repaired,
  from the last checkpoint. The floor every resilient system is measured against.
- ``ckpt-restart``: the common practice described by Llama 3 (Dubey et al., 2024, §3.3.4)
  and the Greyhound characterisation (Wu et al., ATC'25, §2: "treat fail-slows as
  fail-stops by checkpoint-and-restart"): the launcher's agent sees a process exit at once
  and a silent node after the heartbeat timeout; the job rolls back to the last
  checkpoint and relaunches *elastically* on the devices left, dropping the data-parallel replicas that lost a device and keeping
  the global batch by gradient accumulation (TorchElastic-style). When the node is
  repaired it restarts again (planned: checkpoint first, so no rollback) at full size.
  Fail-slows are not detected.
- ``ckpt-restart+spare``: as above, but a hot-spare node stands in for the failed one, so
  the job relaunches at full size; a repaired node refills the pool. With the pool empty
  it falls back to the elastic shrink.
"""
from __future__ import annotations

from resihp.coordinator.model.plan import Plan
from resihp.sim.engine import Phase, Reaction
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Policy, Settings, Spares, shrink_plan
from resihp.sim.world import FailStop, World, WorldEvent


class CheckpointRestart(Policy):
    name = "ckpt-restart"
    source = "Llama 3 (arXiv:2407.21783 §3.3.4); Greyhound (ATC'25) §2 current practice"

    def __init__(
        self, job: JobSpec, perf: PerfModel, settings: Settings | None = None, *, spare: bool = False,
        shrink: bool = True,
    ) -> None:
        super().__init__(job, perf, settings)
        self.spares = Spares(self.settings.spare_nodes if spare else 0)
        self.shrink = shrink
        self.full = job.initial_plan()
        self.running: Plan | None = self.full  # None: waiting for hardware
        self.restarting_until = -1.0
        if spare and type(self) is CheckpointRestart:
            self.name = "ckpt-restart+spare"

    # --- the job's view of the world ---------------------------------------------------------
    def view(self) -> World:
        return self.spares.masked(self.world)

    def rate_now(self, overlap_p2p: bool = False) -> float:
        """Tokens/s of the running layout, less the checkpoint stalls it relies on."""
        if self.running is None:
            return 0.0
        st = self.settings
        duty = st.checkpoint_interval_s / (st.checkpoint_interval_s + st.checkpoint_stall_s)
        return self.perf.tokens_per_s(self.running, self.view(), overlap_p2p) * duty

    def steady(self, note: str = "", **kw: object) -> Reaction:
        tps = self.rate_now(self.overlap())
        return Reaction(steady_tps=tps, steady_label=self.label_for(tps), note=note, **kw)  # type: ignore[arg-type]

    def overlap(self) -> bool:
        return False

    def dead_in(self, plan: Plan) -> set[int]:
        """Failed devices the plan uses (devices a spare stands in for are not failed)."""
        return {r for r in self.world.dead_ranks() if r not in self.spares.standing_in and plan.has_rank(r)}

    def relaunch_plan(self) -> tuple[Plan | None, Spares]:
        """The layout a (re)launch would get now — full size if the devices (or spares)
        allow — and the spare pool after it (commit it only if the relaunch happens)."""
        dead = self.dead_in(self.full)
        pool = Spares(self.spares.free, set(self.spares.standing_in))
        if not dead:
            return self.full, pool
        if pool.cover(self.job, sorted(dead)):
            return self.full, pool
        if not self.shrink:
            return None, pool
        return shrink_plan(self.job, self.full, dead), pool

    # --- hooks -----------------------------------------------------------------------------
    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        if isinstance(ev.fault, FailStop):
            if ev.start:
                return self.on_failstop(ev, now)
            return self.on_repair(ev, now)
        return self.on_failslow(ev, now)

    def on_failslow(self, ev: WorldEvent, now: float) -> Reaction:
        return self.steady()

    def on_failstop(self, ev: WorldEvent, now: float) -> Reaction:
        hit = self.running is not None and bool(self.dead_in(self.running))
        if not hit and self.running is not None:
            return self.steady(f"{ev.label}: devices not in use")
        lost = self.rollback_tokens(now)
        self.running, self.spares = self.relaunch_plan()
        return self._relaunch(now, lost, detect=self.detect_stop_s(ev.fault), note=f"{ev.label}: crash, roll back {lost:.3g} tokens")

    def on_repair(self, ev: WorldEvent, now: float) -> Reaction:
        self.spares.on_repair(self.job, ev, self.world)
        if self.running is self.full:
            return self.steady()
        candidate, pool = self.relaunch_plan()
        if candidate is None:
            return self.steady()
        better = self.perf.tokens_per_s(candidate, pool.masked(self.world)) > self.rate_now() * 1.001
        if not better:
            return self.steady()
        waiting = self.running is None
        self.running, self.spares = candidate, pool
        if now < self.restarting_until and not waiting:
            # a relaunch is already under way: it simply starts with the bigger layout
            return self.steady(f"{ev.label}: relaunch under way picks up the repaired node")
        return self._relaunch(now, 0.0, detect=0.0, note=f"{ev.label}: planned restart at full size")

    def _relaunch(self, now: float, lost: float, detect: float, note: str) -> Reaction:
        if self.running is None:
            self.restarting_until = -1.0
            return Reaction(0.0, "down", keep_phases=False, lost_tokens=lost, note=note + "; waiting for repair")
        phases = []
        if detect > 0:
            phases.append(Phase(detect, 0.0, "down"))
        phases.append(Phase(self.settings.restart_s, 0.0, "restart"))
        self.restarting_until = now + sum(p.duration_s for p in phases)
        self.run_start = self.restarting_until
        tps = self.rate_now(self.overlap())
        return Reaction(
            tps, self.label_for(tps), tuple(phases), keep_phases=False, lost_tokens=lost, restarts=1, note=note,
        )


class Static(CheckpointRestart):
    name = "static"
    source = "no adaptation: relaunch the same layout from the last checkpoint once repaired"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings, spare=False, shrink=False)
        self.name = "static"
