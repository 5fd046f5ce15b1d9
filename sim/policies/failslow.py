"""Fail-slow baselines: Greyhound-like (multi-level mitigation by ski rental) and
Adaptra-like (pipeline schedule adapted to slow communication).

Both come from systems that target fail-slows only; a fail-stop is left to the host
framework, modelled as checkpoint-restart with a spare node (the stronger of the two
restart variants). Both detect a slowdown the way their papers describe: a change-point
on iteration times (BOCD) flags it after ``failslow_detect_iters`` iterations, then
profiling validates and localises it in ``failslow_validate_s``; a recovery is noticed the
same way. The change-point delay is measured: the Greyhound-style BOCD baseline
(sim/detect_baselines.py) runs on the iteration times of the same realistic probe the
real detector is measured on (sim/detection.py); a slowdown BOCD does not flag is never
mitigated. A recovery is taken to be noticed after ``failslow_detect_iters`` iterations.

Greyhound (Wu et al., USENIX ATC'25, "Greyhound: Hunting Fail-Slows in Hybrid-Parallel
Training at Scale"; arXiv:2410.12588 as FALCON). Its mitigation escalates through levels:
S1 do nothing; S2 micro-batch tuning — data-parallel replicas get micro-batch shares that
balance their iteration times; S3 topology adjustment — the slow nodes are swapped into
as few replicas as possible (those replicas then get fewer micro-batches), paying a
regroup and the swapped nodes' state; S4 checkpoint-and-restart without the slow nodes
(a spare stands in; without one the replicas holding them are dropped). It escalates by
the ski-rental rule: stay at a level until the throughput lost relative to the next level
equals the next level's one-off cost (its pause × its throughput), then move up.

Adaptra (Wu et al., arXiv:2504.19232, "Adaptra: Straggler-Resilient Hybrid-Parallel
Training with Pipeline Adaptation"). Once slow communication is detected it adapts the
1F1B schedule (more warm-up slack) so that point-to-point delays are absorbed instead of
cascading, and moves communication to CPU-side RDMA so it no longer blocks compute
kernels: modelled as overlapping each stage's send/recv with its compute
(max(compute, p2p) instead of their sum). Data-parallel all-reduce slowdowns and compute
stragglers are outside what it mitigates.
"""
from __future__ import annotations

import math
from dataclasses import replace

from resihp.coordinator.model.plan import Plan
from resihp.sim.detection import oracle_for
from resihp.sim.engine import Phase, Reaction
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Settings, Spares, node_ranks, pipeline_from_nodes, rebalance, shrink_plan
from resihp.sim.policies.restart import CheckpointRestart
from resihp.sim.world import FailSlow, WorldEvent


class _DetectsSlow(CheckpointRestart):
    """Checkpoint-restart (+spare) for fail-stops, change-point detection for fail-slows."""

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings, spare=True)
        self.known: dict[int, FailSlow] = {}  # fault id -> detected fail-slow still believed active
        self.fault_by_id: dict[int, FailSlow] = {}
        self.measure = True  # BOCD delays measured on realistic timings (tests may fix them)

    def detect_delay_s(self, fault: FailSlow | None = None) -> float | None:
        """Seconds until the change-point detector flags ``fault`` and profiling validates
        it: the BOCD baseline's iteration count measured on realistic timings of this
        model (sim/detection.py), else ``failslow_detect_iters``; None if BOCD misses it."""
        t_iter = self.perf.iteration_s(self.running, self.view()) if self.running is not None else math.inf
        if not math.isfinite(t_iter):
            t_iter = 0.0
        iters: int | None = self.settings.failslow_detect_iters
        if fault is not None and self.measure:
            oracle = oracle_for(self.job.model, self.job.tp, self.job.tokens_per_microbatch)
            iters = oracle.failslow("compute" if fault.slow_kind == "compute" else "communication", fault.factor).bocd_iters
        if iters is None:
            return None
        return iters * t_iter + self.settings.failslow_validate_s

    def on_failslow(self, ev: WorldEvent, now: float) -> Reaction:
        assert isinstance(ev.fault, FailSlow)
        if ev.start:
            delay = self.detect_delay_s(ev.fault)
            if delay is None:
                return self.steady(f"{ev.label}: the change-point detector does not flag it")
            return self.steady(timers=((now + delay, f"detect:{ev.fault_id}"),))
        # recovery: the iteration time drops back; noticed after the same fixed window
        delay = self.detect_delay_s(None)
        assert delay is not None
        return self.steady(timers=((now + delay, f"recover:{ev.fault_id}"),))

    def on_timer(self, tag: str, now: float) -> Reaction:
        kind, _, rest = tag.partition(":")
        if kind == "detect":
            fid = int(rest)
            fault = self._active_fault(fid)
            if fault is None:
                return self.steady()
            self.known[fid] = fault
            return self.mitigate(now, f"fail-slow#{fid} detected")
        if kind == "recover":
            if self.known.pop(int(rest), None) is None:
                return self.steady()
            return self.recovered(now, f"recovery#{rest} detected")
        return self.on_other_timer(kind, rest, now)

    def _active_fault(self, fid: int) -> FailSlow | None:
        w = self.world
        for d in list(w.slow.values()) + list(w.net.values()):
            if fid in d:
                break
        else:
            return None
        return self.fault_by_id.get(fid)

    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        if isinstance(ev.fault, FailSlow):
            self.fault_by_id[ev.fault_id] = ev.fault
        return super().on_world(ev, now)

    def mitigate(self, now: float, note: str) -> Reaction:
        return self.steady(note)

    def recovered(self, now: float, note: str) -> Reaction:
        return self.steady(note)

    def on_other_timer(self, kind: str, rest: str, now: float) -> Reaction:
        return self.steady()


class Greyhound(_DetectsSlow):
    name = "greyhound"
    source = "Wu et al., Greyhound, USENIX ATC'25 (arXiv:2410.12588): S1–S4 by ski rental, fail-slow only"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings)
        self.level = 1
        self.gen = 0
        self.excluded_nodes: set[int] = set()

    # --- the levels ------------------------------------------------------------------------
    def _slow_nodes(self) -> set[int]:
        out: set[int] = set()
        for f in self.known.values():
            out |= {r // self.job.gpus_per_node for r in f.ranks}
        return out

    def _replica_nodes(self, plan: Plan) -> list[list[int]]:
        out = []
        for rep in plan.replicas:
            seen: list[int] = []
            for r in rep.ranks():
                n = r // self.job.gpus_per_node
                if n not in seen:
                    seen.append(n)
            out.append(seen)
        return out

    def _s3_plan(self, plan: Plan) -> tuple[Plan, float]:
        """Swap slow nodes into as few replicas as possible, then rebalance shares."""
        key = (id(plan), frozenset(self._slow_nodes()), self.world.version)
        cached = self.__dict__.get("_s3_cache")
        if cached is not None and cached[0] == key and cached[1] is plan:
            return cached[2]  # type: ignore[no-any-return]
        out = self._s3_build(plan)
        self.__dict__["_s3_cache"] = (key, plan, out)
        return out

    def _s3_build(self, plan: Plan) -> tuple[Plan, float]:
        pipes = self._replica_nodes(plan)
        slow = self._slow_nodes()
        if any(len(p) * self.job.gpus_per_node != len(rep.ranks()) for p, rep in zip(pipes, plan.replicas)):
            return plan, 0.0  # replicas not made of whole nodes: nothing to swap
        per = len(pipes[0]) if pipes else 1
        needed = -(-sum(n in slow for p in pipes for n in p) // max(1, per))
        order = sorted(range(len(pipes)), key=lambda i: (-sum(n in slow for n in pipes[i]), i))
        targets, others = order[:needed], order[needed:]
        swaps = 0
        for i in others:
            for j, n in enumerate(pipes[i]):
                if n not in slow:
                    continue
                for t in targets:
                    free = [k for k, m in enumerate(pipes[t]) if m not in slow]
                    if free:
                        k = free[0]
                        pipes[i][j], pipes[t][k] = pipes[t][k], pipes[i][j]
                        swaps += 1
                        break
        if not swaps:
            return plan, 0.0
        reps = tuple(pipeline_from_nodes(self.job, p, rep.microbatches) for p, rep in zip(pipes, plan.replicas))
        moved = Plan(reps, plan.schedule, epoch=plan.epoch + 1, reason="greyhound S3: slow nodes consolidated")
        per_gpu = (max(plan.replicas[0].layers) * self.job.model.params_per_layer()
                   * self.perf.memory.moved_bytes_per_param / self.job.tp)
        pause = self.settings.regroup_s + per_gpu / self.job.inter_node_bw_Bps
        return rebalance(self.perf, moved, self.view()), pause

    def _s4(self) -> tuple[Plan | None, float, int]:
        """Restart without the slow nodes: a spare if the pool allows, else shrink."""
        nodes = sorted(self._slow_nodes() - self.excluded_nodes)
        if not nodes or self.running is None:
            return None, 0.0, 0
        if self.spares.free >= len(nodes):
            return self.full, self.settings.restart_s, len(nodes)
        dead = self.dead_in(self.running)
        shrunk = shrink_plan(self.job, self.full, {r for n in nodes for r in node_ranks(self.job, n)} | dead)
        return shrunk, self.settings.restart_s, 0

    def _s4_rate(self, plan: Plan, spare_nodes: int) -> float:
        if not spare_nodes:
            return self.perf.tokens_per_s(plan, self.view())
        trial = Spares(self.spares.free, set(self.spares.standing_in))
        nodes = sorted(self._slow_nodes() - self.excluded_nodes)
        trial.cover(self.job, [r for n in nodes for r in node_ranks(self.job, n)])
        hidden = trial.masked(self.world)
        for n in nodes:  # the slow nodes leave the job: their slowness no longer counts
            for r in node_ranks(self.job, n):
                hidden.slow.pop(r, None)
            hidden.net.pop(n, None)
        return self.perf.tokens_per_s(plan, hidden)

    def mitigate(self, now: float, note: str) -> Reaction:
        if self.running is None:
            return self.steady(note)
        self.running = rebalance(self.perf, self.running, self.view())  # S2: cheap, immediate
        self.level = 2
        self.gen += 1
        return self._schedule_escalation(now, note + "; S2 micro-batch tuning")

    def _candidates(self) -> list[tuple[int, float, float]]:
        """(level, throughput, pause) of the levels above the current one."""
        assert self.running is not None
        out = []
        if self.level < 3:
            plan, pause = self._s3_plan(self.running)
            if pause > 0:
                out.append((3, self.perf.tokens_per_s(plan, self.view()), pause))
        if self.level < 4:
            plan4, pause4, spare_nodes = self._s4()
            if plan4 is not None:
                out.append((4, self._s4_rate(plan4, spare_nodes), pause4))
        return out

    def _schedule_escalation(self, now: float, note: str) -> Reaction:
        r_now = self.rate_now()
        timers: tuple[tuple[float, str], ...] = ()
        for level, r_next, pause in self._candidates():
            if r_next > r_now * 1.001:
                wait = pause * r_next / (r_next - r_now)  # ski rental: rent until the loss pays the buy
                timers = ((now + wait, f"escalate:{self.gen}:{level}"),)
                break
        return self.steady(note, timers=timers)

    def on_other_timer(self, kind: str, rest: str, now: float) -> Reaction:
        if kind != "escalate" or self.running is None or not self.known:
            return self.steady()
        gen, _, level_s = rest.partition(":")
        if int(gen) != self.gen:
            return self.steady()
        level = int(level_s)
        if level == 3:
            plan, pause = self._s3_plan(self.running)
            self.running, self.level = plan, 3
            rx = self._schedule_escalation(now + pause, "S3 topology adjustment")
            return replace(rx, phases=(Phase(pause, 0.0, "reconfig"),), reconfigurations=1)
        plan4, pause, spare_nodes = self._s4()
        if plan4 is None:
            return self.steady()
        nodes = sorted(self._slow_nodes() - self.excluded_nodes)
        if spare_nodes:
            self.spares.cover(self.job, [r for n in nodes for r in node_ranks(self.job, n)])
        self.excluded_nodes |= set(nodes)
        self.running, self.level = plan4, 4
        self.run_start = self.restarting_until = now + pause
        tps = self.rate_now()
        return Reaction(tps, self.label_for(tps), (Phase(pause, 0.0, "restart"),), restarts=1,
                        note="S4 checkpoint-and-restart without the slow nodes")

    def recovered(self, now: float, note: str) -> Reaction:
        if self.known or self.running is None:
            return self.mitigate(now, note)  # others still slow: re-tune for what is left
        self.gen += 1
        self.level = 1
        for n in sorted(self.excluded_nodes):  # a recovered excluded node refills the spare pool
            ranks = set(node_ranks(self.job, n))
            if ranks <= self.spares.standing_in:
                self.spares.standing_in -= ranks
                self.spares.free += 1
        self.excluded_nodes.clear()
        if self.running is not self.full and len(self.running.replicas) < len(self.full.replicas):
            self.running, self.spares = self.relaunch_plan()
            return self._relaunch(now, 0.0, detect=0.0, note=note + ": planned restart at full size")
        self.running = rebalance(self.perf, self.running, self.view())
        return self.steady(note + ": shares back to even")


class Adaptra(_DetectsSlow):
    name = "adaptra"
    source = "Wu et al., Adaptra (arXiv:2504.19232): schedule adaptation + CPU RDMA for slow communication"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        super().__init__(job, perf, settings)
        self.adapted = False

    def overlap(self) -> bool:
        return self.adapted

    def mitigate(self, now: float, note: str) -> Reaction:
        if any(f.slow_kind == "communication" for f in self.known.values()) and not self.adapted:
            self.adapted = True
            return self.steady(note + ": pipeline schedule adapted, p2p offloaded to CPU RDMA", reconfigurations=1)
        return self.steady(note + ": compute straggler, no mitigation")
