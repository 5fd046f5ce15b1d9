"""bench/detect.py's in-flight section: compute slowdowns found within the iteration they slow,
from heartbeats that name each rank's op (coordinator/detector/inflight.py).

Jobs whose iteration hears ten heartbeats (a 10 s iteration under the hooks' 1 s beats):
TP4 x PP2 x DP2 (LLaMA2-13B) and TP2 x PP2 x DP2 (LLaMA2-7B), every noise class on
(``Noise.everything``: GC pauses, loader and checkpoint stalls, co-tenant episodes, congestion).
Healthy runs count every finding; slow runs put one GPU (a stage-0 or a stage-1 TP member) at
2, 3 or 4x from iteration ``ONSET`` and read when and at what factor it is found: the share of
the slowed iteration elapsed at the finding (< 1: before that iteration's record).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import IterationRecord
from resihp.sim.workload import Fault, Noise, WorkloadConfig, generate, make_header

JOBS = {
    "13b-tp4pp2dp2": (preset("llama2-13b"), Plan.uniform(4, 2, 2, 40, 8)),
    "7b-tp2pp2dp2": (preset("llama2-7b"), Plan.uniform(2, 2, 2, 32, 8)),
}
BEATS_PER_ITERATION = 10
ONSET = 24
FACTORS = (2.0, 3.0, 4.0)


@dataclass
class InFlightResult:
    healthy_runs: int = 0
    healthy_iterations: int = 0
    false_findings: list[str] = field(default_factory=list)
    slow_runs: int = 0
    found_in_flight: int = 0
    shares: list[float] = field(default_factory=list)  # of the slowed iteration, at the finding
    factor_errors: list[float] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)


def _run(name: str, seed: int, iterations: int, faults: tuple[Fault, ...]
         ) -> tuple[list[Finding], dict[int, tuple[float, float]]]:
    model, plan = JOBS[name]
    base = WorkloadConfig(model, plan, budget=8192, seed=seed, iterations=6, heartbeats=False, noise=Noise.quiet())
    usual = float(np.median([r.time_s for r in generate(base) if isinstance(r, IterationRecord)]))
    cfg = WorkloadConfig(model, plan, budget=8192, seed=seed, iterations=iterations, faults=faults,
                         op_beats_s=usual / BEATS_PER_ITERATION, noise=Noise.everything())
    # these iterations (3-7 s) stand for longer ones, their beats scaled alike: the floor that
    # keeps short real iterations out (in_flight_min_iteration_s) is off
    det = Detector(make_header(cfg), DetectorConfig(in_flight_min_iteration_s=0.0))
    found: list[Finding] = []
    spans: dict[int, tuple[float, float]] = {}
    for rec in generate(cfg):
        now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else rec.time_s
        if isinstance(rec, IterationRecord):
            spans[rec.iteration] = (rec.start_s, rec.time_s)
        found += det.observe(rec, now) + det.tick(now)
    return found, spans


def measure(healthy_per_job: int = 4, iterations: int = 120) -> InFlightResult:
    res = InFlightResult()
    for j, name in enumerate(JOBS):
        plan = JOBS[name][1]
        for k in range(healthy_per_job):
            found, _ = _run(name, 500 + 17 * j + k, iterations, ())
            res.healthy_runs += 1
            res.healthy_iterations += iterations
            res.false_findings += [f"{name}/{k}: {f.kind} {f.ranks} it {f.iteration}: {f.reason[:100]}"
                                   for f in found if f.kind != "recovered"]
        for k, factor in enumerate(FACTORS):
            for stage in (0, 1):
                victim = plan.replicas[k % 2].stages[stage][-1]
                found, spans = _run(name, 700 + 31 * j + 2 * k + stage, ONSET + 3,
                                    (Fault("compute", victim, ONSET, factor),))
                res.slow_runs += 1
                hit = next((f for f in found if f.kind in ("fail-slow", "degraded") and victim in f.ranks), None)
                if hit is None or "in flight" not in hit.reason or hit.iteration != ONSET:
                    res.missed.append(f"{name} rank {victim} x{factor}: "
                                      + ("not found" if hit is None else f"found at it {hit.iteration} by records"))
                    continue
                start, dur = spans[ONSET]
                res.found_in_flight += 1
                res.shares.append((hit.time_s - start) / dur)
                res.factor_errors.append(abs(hit.factor / factor - 1.0))
    return res


def report(res: InFlightResult, print_fn: Any = print) -> dict[str, Any]:
    fa = len(res.false_findings) / max(1, res.healthy_runs)
    print_fn(f"in flight ({BEATS_PER_ITERATION} heartbeats per iteration, every noise class on): "
             f"{res.healthy_runs} healthy runs of {res.healthy_iterations // max(1, res.healthy_runs)} iterations, "
             f"{len(res.false_findings)} findings; {res.found_in_flight} of {res.slow_runs} slowdowns of "
             f"{'/'.join(f'{f:g}' for f in FACTORS)}x found within the slowed iteration")
    if res.shares:
        print_fn(f"  found after {min(res.shares):.2f}-{max(res.shares):.2f} of the slowed iteration (median "
                 f"{float(np.median(res.shares)):.2f}); factor error median {float(np.median(res.factor_errors)):.1%}, "
                 f"max {max(res.factor_errors):.1%}")
    for line in res.false_findings + res.missed:
        print_fn(f"  {line}")
    return {
        "in_flight_false_alarms_per_run": round(fa, 3),
        "in_flight_found_fraction_2x_up": round(res.found_in_flight / max(1, res.slow_runs), 3),
        "in_flight_detect_share_max": round(max(res.shares), 3) if res.shares else None,
        "in_flight_factor_error_max": round(max(res.factor_errors), 3) if res.factor_errors else None,
    }


if __name__ == "__main__":
    import json
    import time

    t0 = time.perf_counter()
    out = report(measure())
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    print(json.dumps(out))
