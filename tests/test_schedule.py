"""Pipeline schedule simulator against closed forms, dependency invariants and bad input."""
from __future__ import annotations

import math
import random

import pytest

from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.schedule.simulator import (
    Op,
    PipelineResult,
    ReplicaWork,
    bubble_fraction_1f1b,
    bubble_fraction_interleaved,
    bubble_fraction_zb_h1,
    one_f_one_b_time,
    simulate_iteration,
    simulate_pipeline,
)

Table = list[list[float]]


def _const(rows: int, m: int, value: float) -> Table:
    return [[value] * m for _ in range(rows)]


def _rand(rng: random.Random, rows: int, m: int) -> Table:
    return [[rng.uniform(0.5, 2.0) for _ in range(m)] for _ in range(rows)]


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (3, 7), (4, 2), (1, 5), (16, 64)])
def test_1f1b_matches_closed_form(p: int, m: int) -> None:
    res = simulate_pipeline(Schedule.ONE_F_ONE_B, _const(p, m, 1.0), _const(p, m, 2.0), pp=p)
    assert res.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert res.bubble_ratio == pytest.approx(bubble_fraction_1f1b(p, m)) == pytest.approx((p - 1) / m)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))  # idle / makespan
    assert res.idle_s == pytest.approx([(p - 1) * 3.0] * p)
    assert res.busy_s == pytest.approx([m * 3.0] * p)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 12), (8, 2, 16), (2, 2, 4), (4, 2, 4)])
def test_interleaved_matches_closed_form(p: int, v: int, m: int) -> None:
    # each chunk holds 1/v of a device's layers
    res = simulate_pipeline(
        Schedule.INTERLEAVED, _const(p * v, m, 1.0 / v), _const(p * v, m, 2.0 / v), pp=p, virtual_chunks=v
    )
    assert res.bubble_ratio == pytest.approx(bubble_fraction_interleaved(p, v, m)) == pytest.approx((p - 1) / (v * m))
    assert res.makespan_s == pytest.approx(3.0 * m + 3.0 * (p - 1) / v)
    assert {op.chunk for op in res.ops} == set(range(v))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (3, 7), (4, 4), (16, 64)])
def test_zb_h1_matches_closed_form(p: int, m: int) -> None:
    res = simulate_pipeline(Schedule.ZB_H1, _const(p, m, 1.0), _const(p, m, 1.0), _const(p, m, 1.0), pp=p)
    assert res.bubble_ratio == pytest.approx(bubble_fraction_zb_h1(p, m)) == pytest.approx((p - 1) / (3 * m))
    assert res.makespan_s == pytest.approx(3 * m + p - 1)
    # one third of 1F1B's bubble on the same work
    ref = simulate_pipeline(Schedule.ONE_F_ONE_B, _const(p, m, 1.0), _const(p, m, 2.0), pp=p)
    assert res.bubble_ratio == pytest.approx(ref.bubble_ratio / 3)


def test_zb_h1_keeps_1f1b_activation_memory() -> None:
    p, m = 6, 12
    res = simulate_pipeline(Schedule.ZB_H1, _const(p, m, 1.0), _const(p, m, 1.0), _const(p, m, 1.0), pp=p)
    for s in range(p):
        in_flight = peak = 0
        for op in res.device_ops(s):
            in_flight += {"F": 1, "B": -1, "W": 0}[op.kind]
            peak = max(peak, in_flight)
        assert peak == min(p - s, m)
        kinds = [op.kind for op in res.device_ops(s)]
        assert kinds.count("W") == m and kinds[-1] == "W"


@pytest.mark.parametrize("p,m,p2p", [(4, 8, 0.0), (5, 12, 0.0), (3, 6, 0.1), (2, 5, 0.2)])
def test_1f1b_unequal_stages_match_oobleck(p: int, m: int, p2p: float) -> None:
    rng = random.Random(p * 100 + m)
    sf = [rng.uniform(0.5, 1.5) for _ in range(p)]
    sb = [rng.uniform(0.5, 1.5) for _ in range(p)]
    sf[-1], sb[-1] = 2.0, 3.0  # the bottleneck is the last stage: the formula is exact
    res = simulate_pipeline(
        Schedule.ONE_F_ONE_B, [[x] * m for x in sf], [[x] * m for x in sb], pp=p, p2p_s=p2p
    )
    expected = sum(sf) + sum(sb) + (m - 1) * 5.0 + 2 * (p - 1) * p2p
    assert one_f_one_b_time(sf, sb, m, p2p) == pytest.approx(expected)
    assert res.makespan_s == pytest.approx(expected)


def test_oobleck_overestimates_an_early_bottleneck() -> None:
    # a slow first stage hides the round trip of the rest: 4·6 = 24, Oobleck says 26
    res = simulate_pipeline(Schedule.ONE_F_ONE_B, [[3.0] * 4, [1.0] * 4], [[3.0] * 4, [1.0] * 4], pp=2)
    assert res.makespan_s == pytest.approx(24.0)
    assert one_f_one_b_time([3.0, 1.0], [3.0, 1.0], 4) == pytest.approx(26.0)


def _check_invariants(res: PipelineResult, p2p: float) -> None:
    pp, v, m = res.pp, res.virtual_chunks, res.microbatches
    n_virtual = pp * v
    by_key: dict[tuple[str, int, int], Op] = {}
    for op in res.ops:
        key = (op.kind, res.vstage_of(op), op.microbatch)
        assert key not in by_key, f"op {key} scheduled twice"
        by_key[key] = op
        assert op.end_s >= op.start_s >= 0.0
    kinds = "FBW" if any(op.kind == "W" for op in res.ops) else "FB"
    assert len(by_key) == len(kinds) * n_virtual * m

    def hop(a: int, b: int) -> float:
        return p2p if a % pp != b % pp else 0.0

    eps = 1e-9
    for (kind, vs, mb), op in by_key.items():
        if kind == "F" and vs > 0:
            assert op.start_s >= by_key["F", vs - 1, mb].end_s + hop(vs - 1, vs) - eps
        if kind == "B":
            assert op.start_s >= by_key["F", vs, mb].end_s - eps
            if vs < n_virtual - 1:
                assert op.start_s >= by_key["B", vs + 1, mb].end_s + hop(vs + 1, vs) - eps
        if kind == "W":
            assert op.start_s >= by_key["B", vs, mb].end_s - eps
    for s in range(pp):
        dev = res.device_ops(s)
        for a, b in zip(dev, dev[1:]):
            assert b.start_s >= a.end_s - eps, f"overlap on device {s}: {a} / {b}"
        assert res.busy_s[s] == pytest.approx(sum(op.end_s - op.start_s for op in dev))
    # the critical path is a gap-free chain of device-order or dependency edges from 0 to the end
    path = res.critical_path
    assert path[0].start_s == pytest.approx(0.0) and path[-1].end_s == pytest.approx(res.makespan_s)
    for a, b in zip(path, path[1:]):
        gap = hop(res.vstage_of(a), res.vstage_of(b)) if a.stage != b.stage else 0.0
        assert b.start_s == pytest.approx(a.end_s + gap)


@pytest.mark.parametrize(
    "schedule,p,v,m", [(Schedule.ONE_F_ONE_B, 4, 1, 7), (Schedule.INTERLEAVED, 4, 2, 8), (Schedule.ZB_H1, 5, 1, 9),
                       (Schedule.ZB_H1, 4, 1, 2), (Schedule.INTERLEAVED, 3, 3, 3)],
)
def test_every_op_respects_its_dependencies(schedule: Schedule, p: int, v: int, m: int) -> None:
    rng = random.Random(7)
    rows = p * v
    w = _rand(rng, rows, m) if schedule is Schedule.ZB_H1 else None
    speed = [rng.uniform(0.5, 1.5) for _ in range(p)]
    res = simulate_pipeline(
        schedule, _rand(rng, rows, m), _rand(rng, rows, m), w, pp=p, virtual_chunks=v, p2p_s=0.05, speed=speed
    )
    _check_invariants(res, 0.05)


def test_speed_factors_divide_durations() -> None:
    p, m = 4, 8
    f, b = _const(p, m, 1.0), _const(p, m, 2.0)
    base = simulate_pipeline(Schedule.ONE_F_ONE_B, f, b, pp=p)
    half = simulate_pipeline(Schedule.ONE_F_ONE_B, f, b, pp=p, speed=[0.5] * p)
    assert half.makespan_s == pytest.approx(2 * base.makespan_s)
    # one device at half speed becomes the bottleneck: Oobleck with its doubled times
    slow = simulate_pipeline(Schedule.ONE_F_ONE_B, f, b, pp=p, speed=[1, 1, 1, 0.5])
    assert slow.busy_s == pytest.approx([24.0, 24.0, 24.0, 48.0])
    assert slow.makespan_s == pytest.approx(one_f_one_b_time([1, 1, 1, 2], [2, 2, 2, 4], m))
    assert max(slow.critical_path, key=lambda op: op.end_s).end_s == slow.makespan_s


def test_separate_w_is_folded_into_b_outside_zb() -> None:
    p, m = 3, 6
    split = simulate_pipeline(Schedule.ONE_F_ONE_B, _const(p, m, 1.0), _const(p, m, 1.0), _const(p, m, 1.0), pp=p)
    whole = simulate_pipeline(Schedule.ONE_F_ONE_B, _const(p, m, 1.0), _const(p, m, 2.0), pp=p)
    assert split.makespan_s == whole.makespan_s
    assert {op.kind for op in split.ops} == {"F", "B"}


def test_iteration_adds_dp_sync_and_optimizer_after_slowest_replica() -> None:
    p, m = 2, 4
    fast = ReplicaWork(_const(p, m, 1.0), _const(p, m, 2.0))
    slow = ReplicaWork(_const(p, m, 1.0), _const(p, m, 2.0), speed=[1.0, 0.5])
    it = simulate_iteration(Schedule.ONE_F_ONE_B, [fast, slow], dp_sync_s=0.5, optimizer_s=0.25)
    assert it.replica_s[0] == pytest.approx(15.0)
    assert it.replica_s[1] == pytest.approx(one_f_one_b_time([1, 2], [2, 4], m))
    assert it.iteration_s == pytest.approx(it.replica_s[1] + 0.75)
    assert it.slowest_replica == 1
    # plain (f, b, w) tuples; a replica with no micro-batches costs nothing
    it = simulate_iteration(
        Schedule.ZB_H1, [(_const(p, m, 1.0), _const(p, m, 1.0), _const(p, m, 1.0)), ([[], []], [[], []], [[], []])],
        optimizer_s=1.0,
    )
    assert it.replica_s == pytest.approx((3 * m + p - 1, 0.0))
    assert it.iteration_s == pytest.approx(3 * m + p)


def test_bad_input_is_rejected_with_clear_messages() -> None:
    f, b = _const(4, 6, 1.0), _const(4, 6, 1.0)
    one = Schedule.ONE_F_ONE_B
    with pytest.raises(ValueError, match=r"b\[1\]\[2\] = nan: durations must be finite and >= 0"):
        simulate_pipeline(one, f, [[1.0] * 6, [1.0, 1.0, math.nan, 1.0, 1.0, 1.0], *b[2:]], pp=4)
    with pytest.raises(ValueError, match=r"f\[0\]\[0\] = -1.0"):
        simulate_pipeline(one, [[-1.0] * 6, *f[1:]], b, pp=4)
    with pytest.raises(ValueError, match=r"expected shape \(virtual stages=4, micro-batches=6\), got \(3, 6\)"):
        simulate_pipeline(one, f, b[:3], pp=4)
    with pytest.raises(ValueError, match="expected shape"):
        simulate_pipeline(one, f, [[1.0] * 5] * 4, pp=4)
    with pytest.raises(ValueError, match="multiple of pp"):
        simulate_pipeline(Schedule.INTERLEAVED, _const(8, 6, 1.0), _const(8, 6, 1.0), pp=4, virtual_chunks=2)
    with pytest.raises(ValueError, match="zb-h1 splits the backward: pass w"):
        simulate_pipeline(Schedule.ZB_H1, f, b, pp=4)
    with pytest.raises(ValueError, match="speed: expected 4 finite factors > 0"):
        simulate_pipeline(one, f, b, pp=4, speed=[1, 1, 0, 1])
    with pytest.raises(ValueError, match="needs the interleaved-1f1b schedule"):
        simulate_pipeline(one, _const(8, 6, 1.0), _const(8, 6, 1.0), pp=4, virtual_chunks=2)
    with pytest.raises(ValueError, match="p2p_s must be finite"):
        simulate_pipeline(one, f, b, pp=4, p2p_s=-0.1)
    with pytest.raises(ValueError, match="replica 1: .*expected shape"):
        simulate_iteration(one, [(f, b, None), (f, b[:2], None)])
    with pytest.raises(ValueError, match="one entry per stage"):
        one_f_one_b_time([1.0, 2.0], [1.0], 4)
    with pytest.raises(ValueError, match="m >= 1"):
        bubble_fraction_1f1b(4, 0)
