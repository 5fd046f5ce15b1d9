"""Detection delays measured by running the real detector (resihp.coordinator.detector.detector)
on realistic simulated timings (resihp.sim.workload), only where it matters.

Running the detector on every iteration of a day-long 16,384-GPU job would cost hours and
tell nothing new: between faults it only confirms health. So for each kind of fault the
simulator asks once, on a small *proxy* job of the same model and tensor-parallel degree
(2 pipeline stages × 2 replicas; the detector's per-rank ratios and persistence counts do
not depend on the job's width), how many iterations the detector needs to raise the
finding, what slowdown factor it estimates, and how many iterations it needs to declare the
recovery. Results are cached by (model, tp, kind, factor bucket), so a whole benchmark
needs a handful of detector runs. The delay in seconds is that iteration count times the
full job's own (slowed) iteration time.

Fail-stop: an exit event (the process died: GPU, software and NCCL faults) is confirmed on
arrival; a node that goes silent (host, NIC, switch faults) is declared dead at the first
``tick`` after the detector's heartbeat timeout — both measured by feeding the detector
the events. The same probe also runs the Greyhound-style BOCD baseline
(sim/detect_baselines.py) on the iteration times, which is how the Greyhound- and
Adaptra-like policies detect. Pure apart from the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.model.trace import ExitEvent, HeartbeatEvent, IterationRecord
from resihp.sim.detect_baselines import BocdBaseline
from resihp.sim.workload import Fault as WorkloadFault
from resihp.sim.workload import Hardware, WorkloadConfig, generate, make_header

# slowdown factors are snapped down to this grid before the detector is asked
FACTOR_GRID = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


@dataclass(frozen=True)
class SlowDetection:
    detect_iters: int | None  # iterations after onset until the finding (None: never, within the window)
    factor: float  # the detector's estimate
    cause: str  # compute | communication | unknown
    recover_iters: int | None  # iterations after the end until "recovered"
    ranks_found: tuple[int, ...] = ()
    bocd_iters: int | None = None  # the Greyhound-style BOCD baseline on the same iteration times
    degraded: bool = False  # found, but costing less than the impact floor: reported, never acted on
    # found within the slowed iteration from the heartbeats' op states (compute faults; jobs
    # whose iteration hears IN_FLIGHT_BEATS beats): when, as a share of that iteration, and
    # the factor estimated then (None: not found in flight)
    in_flight_share: float | None = None
    in_flight_factor: float | None = None


# beats per iteration the in-flight probe hears: a 10 s iteration under the hooks' 1 s heartbeats.
# A job with shorter iterations is judged by its records (detect_iters)
IN_FLIGHT_BEATS = 10
HEARTBEAT_S = 1.0


@dataclass
class DetectionOracle:
    model: ModelSpec
    tp: int
    tokens_per_microbatch: int = 8192
    config: DetectorConfig = field(default_factory=DetectorConfig)
    seed: int = 0
    onset_iter: int | None = None  # iterations before the fault; None: 4 after the detector judges
    window: int = 12  # iterations the fault lasts in the probe, and the recovery window
    runs: int = 0  # detector runs so far (the benchmark reports it)
    _cache: dict[tuple[object, ...], SlowDetection] = field(default_factory=dict)
    _stop_cache: dict[bool, float] = field(default_factory=dict)

    def _proxy_plan(self) -> Plan:
        return Plan.uniform(self.tp, 2, 2, self.model.num_layers, 8)

    def _proxy_hardware(self) -> Hardware:
        """The proxy's nodes: at most one replica per node, so that its DP rings cross a NIC
        as every full job's do. (Its 4·TP GPUs on one 8-GPU node — TP ≤ 2 — left a slow NIC
        nothing to carry: the probe never found a communication fault and the simulator never
        acted on one.)"""
        per_node = Hardware().gpus_per_node
        return Hardware(gpus_per_node=min(per_node, 2 * self.tp))

    @staticmethod
    def bucket(factor: float) -> float:
        best = FACTOR_GRID[0]
        for g in FACTOR_GRID:
            if g <= factor + 1e-9:
                best = g
        return best

    def failslow(self, kind: str, factor: float) -> SlowDetection:
        """kind: "compute" or "communication"."""
        fb = self.bucket(factor)
        key = (kind, fb)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        plan = self._proxy_plan()
        victim = plan.replicas[0].stages[1][0]  # stage 1 of replica 0
        start = self.onset_iter if self.onset_iter is not None else self.config.judged_from + 4
        end = start + self.window
        wf = WorkloadFault("compute" if kind == "compute" else "link", victim, start, fb, end)
        cfg = WorkloadConfig(
            self.model, plan, budget=self.tokens_per_microbatch, seed=self.seed, iterations=end + self.window + 4,
            faults=(wf,), heartbeats=False, hardware=self._proxy_hardware(),
        )
        det = Detector(make_header(cfg), self.config)
        bocd = BocdBaseline()
        self.runs += 1
        found: Finding | None = None
        recovered_at: int | None = None
        bocd_at: int | None = None
        for rec in generate(cfg):
            if not isinstance(rec, IterationRecord):
                continue
            if bocd.observe(rec.iteration, rec.time_s) and bocd_at is None and rec.iteration >= start:
                bocd_at = rec.iteration
            for f in det.observe(rec, rec.start_s + rec.time_s):
                if victim not in f.ranks:
                    continue  # a false alarm elsewhere; the benchmark of the detector counts those
                if f.kind in ("fail-slow", "degraded") and found is None and rec.iteration >= start:
                    found = f
                elif f.kind == "recovered" and found is not None and recovered_at is None:
                    recovered_at = rec.iteration
        bocd_iters = None if bocd_at is None else bocd_at - start + 1
        share, flight_factor = self._in_flight(cfg, victim, start) if kind == "compute" else (None, None)
        if found is None:
            out = SlowDetection(None, 1.0, "unknown", None, (), bocd_iters)
        else:
            out = SlowDetection(
                found.iteration - start + 1, float(found.factor), found.cause,
                None if recovered_at is None else recovered_at - end + 1, tuple(found.ranks), bocd_iters,
                degraded=found.kind == "degraded", in_flight_share=share, in_flight_factor=flight_factor,
            )
        self._cache[key] = out
        return out

    def _in_flight(self, cfg: WorkloadConfig, victim: int, start: int) -> tuple[float | None, float | None]:
        """The same fault with heartbeats that name each rank's op, ``IN_FLIGHT_BEATS`` per
        healthy iteration: (seconds from the slowed iteration's start to an in-flight finding,
        over that iteration's time; its factor), or (None, None)."""
        run = replace(cfg, heartbeats=False, iterations=start + 3)
        spans = {r.iteration: (r.start_s, r.time_s) for r in generate(run) if isinstance(r, IterationRecord)}
        beat_s = float(np.median([spans[i][1] for i in range(min(start, 8))])) / IN_FLIGHT_BEATS
        run = replace(run, heartbeats=True, op_beats_s=beat_s)
        # the proxy's short iterations stand for the job's long ones, beats scaled alike: the
        # floor that keeps short real iterations out is the policy's to apply (on the full job)
        det = Detector(make_header(run), replace(self.config, in_flight_min_iteration_s=0.0))
        self.runs += 1
        for rec in generate(run):
            now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else rec.time_s
            if isinstance(rec, IterationRecord) and rec.iteration > start:
                break
            for f in det.observe(rec, now):
                if victim in f.ranks and f.kind in ("fail-slow", "degraded") and "in flight" in f.reason:
                    if f.iteration != start:
                        return None, None  # not within the slowed iteration
                    t0, dur = spans[start]
                    return (now - t0) / dur, float(f.factor)
        return None, None

    def estimated_factor(self, det: SlowDetection, factor: float) -> float:
        """The detector's estimate of a slowdown by ``factor``: the probe's relative estimation
        error at the factor's bucket applied to the factor itself. (The probe runs the bucket,
        the grid point at or below the factor: its estimate taken as is reported a 2.58× rank
        as 2.01× and the planner built for that.)"""
        return max(1.0, factor * det.factor / self.bucket(factor))

    def estimated_in_flight_factor(self, det: SlowDetection, factor: float) -> float:
        """As ``estimated_factor``, for the estimate an in-flight finding gives."""
        got = det.in_flight_factor if det.in_flight_factor is not None else det.factor
        return max(1.0, factor * got / self.bucket(factor))

    def failstop_delay_s(self, silent: bool) -> float:
        """Seconds from the failure to the fail-stop finding: an exit event, or silence."""
        if silent in self._stop_cache:
            return self._stop_cache[silent]
        plan = self._proxy_plan()
        header = make_header(WorkloadConfig(self.model, plan, budget=self.tokens_per_microbatch, iterations=1,
                                            hardware=self._proxy_hardware()))
        det = Detector(header, self.config)
        self.runs += 1
        victim = plan.ranks()[1]
        t_fail = 100.0
        for r in plan.ranks():
            det.observe(HeartbeatEvent(r, t_fail - 0.5), t_fail - 0.5)
        delay = math.inf
        if not silent:
            if any(f.kind == "fail-stop" for f in det.observe(ExitEvent(victim, t_fail, -9), t_fail)):
                delay = 0.0
        else:
            t = t_fail
            while t < t_fail + 10 * self.config.heartbeat_timeout_s:
                t += 0.5
                found = det.tick(t)
                for r in plan.ranks():
                    if r != victim:
                        found += det.observe(HeartbeatEvent(r, t), t)
                if any(f.kind == "fail-stop" and victim in f.ranks for f in found):
                    delay = t - t_fail
                    break
        self._stop_cache[silent] = delay
        return delay


_ORACLES: dict[tuple[str, int, int], DetectionOracle] = {}


def oracle_for(model: ModelSpec, tp: int, tokens_per_microbatch: int) -> DetectionOracle:
    """One oracle per (model, tp, tokens): its measurements are shared by every run."""
    key = (model.name, tp, tokens_per_microbatch)
    if key not in _ORACLES:
        _ORACLES[key] = DetectionOracle(model, tp, tokens_per_microbatch)
    return _ORACLES[key]
