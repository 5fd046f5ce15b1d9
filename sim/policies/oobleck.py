"""Oobleck-like policy: pipeline templates re-instantiated around fail-stops.

Model of Oobleck (Jang et al., SOSP'23, "Oobleck: Resilient Distributed Training of Large
Models Using Pipeline Templates"):

- The job is a set of heterogeneous pipelines built from *pipeline templates*, one per
  node count, planned ahead; a template of n nodes has n·(gpus/node ÷ tp) stages with the
  layers split evenly (equal layers ⇒ the min-max split is the even one).
- Failures are handled at node granularity: the pipeline that loses a node is
  re-instantiated from the template with one node fewer; a pipeline that falls below the
  smallest template that fits in memory is dissolved and its nodes are lent to the
  smallest remaining pipelines. Missing layers are copied from the other replicas
  (bytes / inter-node bandwidth, in parallel per receiving device) — no rollback, only the
  in-flight iteration is lost. Reconfiguration = detection + regroup + copy.
- The global batch is redistributed across pipelines to balance their iteration times
  (integer micro-batch shares minimising the slowest pipeline).
- A repaired node is added back to the smallest pipeline (another reconfiguration).
- Fail-slows are not handled (Oobleck targets fail-stop only): the job runs at the
  slowed speed.
"""
from __future__ import annotations

import math
from dataclasses import replace

from resihp.coordinator.model.plan import Plan
from resihp.sim.engine import Phase, Reaction
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Policy, Settings, best_shares, node_ranks, pipeline_from_nodes
from resihp.sim.world import FailStop, WorldEvent


class Oobleck(Policy):
    name = "oobleck"
    source = "Jang et al., Oobleck, SOSP'23 (arXiv:2309.08125): pipeline templates, fail-stop only"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings)
        per_pipe = job.pp * job.tp // job.gpus_per_node
        if per_pipe < 1 or (job.pp * job.tp) % job.gpus_per_node:
            raise ValueError(
                f"oobleck model needs whole nodes per pipeline; tp×pp = {job.tp * job.pp} with {job.gpus_per_node}-GPU nodes"
            )
        self.pipelines: list[list[int]] = [list(range(d * per_pipe, (d + 1) * per_pipe)) for d in range(job.dp)]
        self.min_nodes = self._min_nodes(per_pipe)
        # a pipeline cannot have more stages than layers
        self.max_nodes = max(per_pipe, job.model.num_layers // max(1, job.gpus_per_node // job.tp))
        self.down = False

    def _min_nodes(self, upper: int) -> int:
        for n in range(1, upper + 1):
            if len(pipeline_from_nodes(self.job, list(range(n)), 1).stages) > self.job.model.num_layers:
                continue
            if self.perf.replica_fits(pipeline_from_nodes(self.job, list(range(n)), self.job.microbatches), self.plan.schedule):
                return n
        return upper

    def _dead_nodes(self) -> set[int]:
        return {self.world.node_of(r) for r in self.world.dead_ranks()}

    def _instantiate(self) -> Plan | None:
        pipes = [list(p) for p in self.pipelines if p]
        if not pipes:
            return None
        reps = [pipeline_from_nodes(self.job, p, 1) for p in pipes]
        draft = Plan(tuple(reps), self.plan.schedule)
        funcs = []
        for i in range(len(reps)):
            costs = self.perf.replica_stage_costs(draft, i, self.world)
            funcs.append(lambda m, c=costs: self.perf.pipeline_s(c, m))
        shares = best_shares(funcs, self.job.microbatches)
        return Plan(tuple(replace(r, microbatches=m) for r, m in zip(reps, shares)), self.plan.schedule, epoch=self.plan.epoch + 1)

    def _rebuild_pipelines(self) -> None:
        dead = self._dead_nodes()
        pipes = [[n for n in p if n not in dead] for p in self.pipelines]
        pipes.sort(key=len)
        while pipes and len(pipes[0]) < self.min_nodes:
            orphan = pipes.pop(0)
            if not pipes:
                pipes = [orphan] if len(orphan) >= self.min_nodes else []
                break
            for n in orphan:  # lend the nodes to the smallest pipelines
                self._lend(pipes, n)
            pipes.sort(key=len)
        self.pipelines = pipes

    def _lend(self, pipes: list[list[int]], node: int) -> None:
        """Give a node to the smallest pipeline that can still grow (else it idles)."""
        pipes.sort(key=len)
        for p in pipes:
            if len(p) < self.max_nodes:
                p.append(node)
                return

    def _copy_s(self, old: Plan, new: Plan) -> float:
        """Each device receives the layers it did not hold (weights + optimizer state)."""
        held: dict[int, set[int]] = {}
        for rep in old.replicas:
            for s, (a, b) in enumerate(rep.layer_ranges()):
                for r in rep.stages[s]:
                    held[r] = set(range(a, b))
        worst = 0.0
        per_layer = self.job.model.params_per_layer() * self.perf.memory.moved_bytes_per_param
        for rep in new.replicas:
            for s, (a, b) in enumerate(rep.layer_ranges()):
                group = rep.stages[s]
                for r in group:
                    missing = len(set(range(a, b)) - held.get(r, set()))
                    worst = max(worst, missing * per_layer / len(group))
        return worst / self.job.inter_node_bw_Bps

    def _reconfigure(self, now: float, detect: float | None, lost: float, note: str) -> Reaction:
        old = self.plan
        new = self._instantiate()
        if new is None:
            self.down = True
            return Reaction(0.0, "down", keep_phases=False, lost_tokens=lost, note=note + ": no pipeline fits; waiting")
        self.down = False
        self.plan = new
        pause = self.settings.regroup_s + self._copy_s(old, new)
        phases = [Phase(detect, 0.0, "down")] if detect else []
        phases.append(Phase(pause, 0.0, "reconfig"))
        tps = self.rate()
        return Reaction(
            tps, self.label_for(tps), tuple(phases), keep_phases=detect is None, lost_tokens=lost, reconfigurations=1,
            note=f"{note}: {len(new.replicas)} pipelines of {[len(p) for p in self.pipelines]} nodes",
        )

    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        if not isinstance(ev.fault, FailStop):
            return self.steady() if not self.down else Reaction(0.0, "down")
        if ev.start:
            if not self.down and not any(self.plan.has_rank(r) for r in self.world.dead_ranks()):
                return self.steady()
            lost = 0.0 if self.down else self.inflight_tokens(now)
            self._rebuild_pipelines()
            return self._reconfigure(now, self.detect_stop_s(ev.fault), lost, f"{ev.label}")
        # repair: the node joins the smallest pipeline
        used = {n for p in self.pipelines for n in p}
        back = [n for n in sorted({self.world.node_of(r) for r in ev.fault.ranks})
                if n not in used and all(self.world.alive(r) for r in node_ranks(self.job, n))]
        if not back:
            return self.steady() if not self.down else Reaction(0.0, "down")
        for n in back:
            if self.pipelines:
                self._lend(self.pipelines, n)
            else:
                self.pipelines = [[n]]
        self._rebuild_pipelines()
        return self._reconfigure(now, None, 0.0, f"{ev.label}: node rejoins")

    def steady(self, note: str = "", **kw: object) -> Reaction:
        if self.down:
            return Reaction(0.0, "down", note=note)
        tps = self.rate()
        if not math.isfinite(tps):
            tps = 0.0
        return Reaction(steady_tps=tps, steady_label=self.label_for(tps), note=note, **kw)  # type: ignore[arg-type]

