"""A compute slowdown found within the iteration it slows, from the heartbeats' op states
(coordinator/detector/inflight.py), on generated jobs whose heartbeats name each rank's op."""
from __future__ import annotations

import numpy as np
import pytest

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.detector.inflight import MIN_BEATS, InFlight
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import HeartbeatEvent, IterationRecord, OpState
from resihp.sim.workload import Fault, Noise, WorkloadConfig, generate, make_header

MODEL = preset("llama2-13b")
PLAN = Plan.uniform(4, 2, 2, MODEL.num_layers, 8)  # 16 ranks: a slow GPU's 3 TP mates wait for it
VICTIM = PLAN.replicas[0].stages[1][2]
ONSET = 24
BEATS_PER_ITERATION = 10  # a 10 s iteration under the hooks' 1 s heartbeats


def _usual_s(seed: int) -> float:
    cfg = WorkloadConfig(MODEL, PLAN, budget=8192, seed=seed, iterations=6, heartbeats=False, noise=Noise.quiet())
    return float(np.median([r.time_s for r in generate(cfg) if isinstance(r, IterationRecord)]))


# these jobs' 3 s iterations stand for 10 s ones, their heartbeats scaled alike: the floor
# that keeps short real iterations out (in_flight_min_iteration_s) is off
SCALED = 0.0


def _run(faults: tuple[Fault, ...], seed: int = 0, iterations: int = 40, in_flight: bool = True,
         min_iteration_s: float = SCALED) -> tuple[list[Finding], dict[int, tuple[float, float]]]:
    cfg = WorkloadConfig(MODEL, PLAN, budget=8192, seed=seed, iterations=iterations, faults=faults,
                         op_beats_s=_usual_s(seed) / BEATS_PER_ITERATION, noise=Noise.everything())
    det = Detector(make_header(cfg), DetectorConfig(in_flight=in_flight, in_flight_min_iteration_s=min_iteration_s))
    found: list[Finding] = []
    spans: dict[int, tuple[float, float]] = {}
    for rec in generate(cfg):
        now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else rec.time_s
        if isinstance(rec, IterationRecord):
            spans[rec.iteration] = (rec.start_s, rec.start_s + rec.time_s)
        found += det.observe(rec, now) + det.tick(now)
    return found, spans


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_a_slow_gpu_is_found_within_the_first_iteration_it_slows(factor: float) -> None:
    found, spans = _run((Fault("compute", VICTIM, ONSET, factor),))
    slow = [f for f in found if f.kind == "fail-slow"]
    assert [f.ranks for f in slow] == [(VICTIM,)], [(f.kind, f.ranks, f.reason[:80]) for f in found]
    f = slow[0]
    start, end = spans[ONSET]
    assert start < f.time_s < end, (start, f.time_s, end)  # before the slowed iteration's record
    assert f.cause == "compute" and "in flight" in f.reason
    assert f.factor == pytest.approx(factor, rel=0.2)
    assert f.evidence["cost_share"] > 0.01


@pytest.mark.parametrize("in_flight, min_iteration_s", [(False, SCALED), (True, DetectorConfig().in_flight_min_iteration_s)])
def test_without_in_flight_judging_the_same_slowdown_waits_for_the_records(in_flight: bool, min_iteration_s: float) -> None:
    # switched off, or a job whose usual iteration is under the floor (5 s by default)
    found, spans = _run((Fault("compute", VICTIM, ONSET, 2.0),), in_flight=in_flight, min_iteration_s=min_iteration_s)
    f = next(f for f in found if f.kind == "fail-slow")
    assert f.ranks == (VICTIM,) and f.time_s >= spans[ONSET][1] and "in flight" not in f.reason


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_healthy_jobs_under_every_noise_class_raise_nothing_in_flight(seed: int) -> None:
    # loader and checkpoint stalls, GC pauses, co-tenant episodes, congestion: no rank is both
    # the only busy one and moving on while its peers wait
    found, _ = _run((), seed=seed, iterations=60)
    assert found == [], [(f.kind, f.ranks, f.reason[:120]) for f in found]


def test_a_stuck_rank_is_a_hang_not_a_slowdown() -> None:
    # it holds one op: the no-progress rule names it, the in-flight rule (moving ranks only) does not
    found, _ = _run((Fault("stop", VICTIM, ONSET, exit_event=False, stuck=True),), iterations=ONSET + 2)
    assert [(f.kind, f.ranks, f.cause) for f in found] == [("fail-stop", (VICTIM,), "no-progress")], found


def _beats(w: InFlight, t: float, free: set[int], seq: dict[int, int], ranks: range, new_op: bool = True) -> None:
    for r in ranks:
        seq[r] += r in free and new_op
        w.beat(r, t, OpState("compute", "F", False, seq[r]) if r in free else OpState("p2p", "wait", False, seq[r]))


def test_a_whole_busy_replica_is_no_culprit_but_one_busy_rank_is() -> None:
    ranks = range(8)  # two replicas of four
    for busy, want in (({0, 1, 2, 3}, None), ({2}, 2)):
        w = InFlight(ranks)
        seq = {r: 0 for r in ranks}
        t = 0.0
        for _ in range(6):  # healthy iterations of 10 s, everyone busy half of the time
            for b in range(10):
                t += 1.0
                _beats(w, t, set(ranks) if b % 2 == 0 else set(), seq, ranks)
            w.progress(t, 10.0)
        start = t
        for b in range(MIN_BEATS + 10):  # an iteration that outlasts the usual 10 s: ops take 2 beats
            t += 1.0
            _beats(w, t, busy, seq, ranks, new_op=b % 2 == 0)
        v = w.judge(t)
        assert (v.rank if v else None) == want, (busy, v)
        assert v is None or (v.elapsed_s == pytest.approx(t - start) and v.factor == pytest.approx(2.0, rel=0.1))


def test_the_coordinators_way_op_states_only_then_a_tick_finds_it_too() -> None:
    # the coordinator keeps liveness itself: it hands the detector each beat's op
    # (observe_op) and ticks, never a HeartbeatEvent
    cfg = WorkloadConfig(MODEL, PLAN, budget=8192, seed=0, iterations=ONSET + 2,
                         faults=(Fault("compute", VICTIM, ONSET, 3.0),),
                         op_beats_s=_usual_s(0) / BEATS_PER_ITERATION, noise=Noise.everything())
    det = Detector(make_header(cfg), DetectorConfig(in_flight_min_iteration_s=SCALED))
    found: list[Finding] = []
    for rec in generate(cfg):
        if isinstance(rec, IterationRecord):
            found += det.observe(rec, rec.start_s + rec.time_s)
        elif isinstance(rec, HeartbeatEvent) and rec.op is not None:
            det.observe_op(rec.rank, rec.time_s, rec.op)
            found += det.tick(rec.time_s)
    slow = [f for f in found if f.kind == "fail-slow"]
    assert [f.ranks for f in slow] == [(VICTIM,)] and "in flight" in slow[0].reason, found
