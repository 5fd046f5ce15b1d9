"""Pricing a re-plan's new cost keys from the earlier fits, and the pauses the schedule leaves out."""
from __future__ import annotations

import pytest

from resihp.coordinator.detector.seeds import Key, KeyShapes, PauseShare, seed_compute, seed_level, seed_p2p
from resihp.coordinator.model.spec import preset

TINY = preset("gpt-tiny")  # 8 layers, hidden 64, vocab 256
SHAPES = KeyShapes(TINY)


def test_a_compute_seed_scales_the_fits_of_its_tp_size_by_flops() -> None:
    fitted: dict[Key, tuple[float, float, float]] = {("compute", "F", 0, 2, "first", 1): (1e-6, 2e-9, 1e-3),
              ("compute", "F", 2, 4, "", 1): (1e-6, 2e-9, 1e-3),
              ("compute", "B", 0, 2, "first", 1): (5e-6, 5e-9, 5e-3)}  # another kind: not used for F
    got = seed_compute(("compute", "F", 0, 4, "first", 1, ("tag",)), fitted, SHAPES)
    assert got is not None
    (a, b, g), crossed = got
    assert not crossed and a == pytest.approx(2e-6) and b == pytest.approx(4e-9) and g == pytest.approx(2e-3)
    # the last stage adds the head's matmul: more per-token work than the layers alone
    (a_last, _, _), _ = seed_compute(("compute", "F", 4, 8, "last", 1), fitted, SHAPES) or ((0, 0, 0), True)
    assert a_last > 2e-6
    # only another TP size fitted: FLOPs halve with TP2 -> the seed doubles, flagged as a crossing
    tp2: dict[Key, tuple[float, float, float]] = {("compute", "F", 0, 4, "first", 2): (1e-6, 2e-9, 1e-3)}
    (a1, b1, g1), crossed = seed_compute(("compute", "F", 0, 4, "first", 1), tp2, SHAPES) or ((0, 0, 0), False)
    assert crossed and a1 == pytest.approx(2e-6) and b1 == pytest.approx(4e-9) and g1 == pytest.approx(1e-3)
    assert seed_compute(("compute", "W", 0, 4, "", 1), fitted, SHAPES) is None  # nothing of its kind


def test_a_p2p_seed_is_the_same_hops_fit_and_levels_scale_with_the_shard() -> None:
    hops: dict[Key, tuple[float, float, float]] = {("p2p", "F", 4, 1, False): (1e-7, 0.0, 2e-4), ("p2p", "F", 2, 1, True): (9e-7, 0.0, 9e-4),
            ("p2p", "B", 4, 1, False): (3e-7, 0.0, 3e-4)}
    assert seed_p2p(("p2p", "F", 6, 1, False, ("t",)), hops) == (1e-7, 0.0, 2e-4)  # same direction, same crossing
    assert seed_p2p(("p2p", "B", 2, 1, True), hops) is None
    ring = ("dp", ((0, 4),), 1, 2)
    levels: dict[Key, float] = {ring: 0.01, ("opt", ((0, 4),), 1): 0.004, ("dp", ((0, 8),), 1, 1): 0.0}
    # half the layers (no embedding at the far end) over a 4-ring: 2(3)/4 against 2(1)/2
    got = seed_level(("dp", ((4, 8),), 1, 4), levels, SHAPES)
    per_layer = TINY.params_per_layer()
    want = 0.01 * (4 * per_layer + TINY.embedding_params()) / (4 * per_layer + TINY.embedding_params()) * 1.5
    assert got == pytest.approx(want)
    assert seed_level(("dp", ((0, 8),), 1, 1), levels, SHAPES) is None  # a replica alone: no ring
    assert seed_level(("opt", ((0, 2),), 2), levels, SHAPES) == pytest.approx(
        0.004 * (2 * per_layer + TINY.embedding_params()) / 2 / (4 * per_layer + TINY.embedding_params()))


def test_the_pause_gap_follows_healthy_iterations_and_refuses_a_slow_one() -> None:
    p = PauseShare(window=8)
    assert p.predict(0.05) == 0.05  # nothing learnt: the schedule alone
    for observed in (0.11, 0.12, 0.115, 0.118, 0.121):
        p.learn(observed, 0.057)
    assert p.predict(0.057) == pytest.approx(0.118)
    p.learn(0.3, 0.057)  # a 2.5x iteration: a sick device the detector has not confirmed yet
    assert p.predict(0.057) == pytest.approx(0.118)
    p.reseed()  # a new plan: the old gap is its first sample, two of its own outvote it
    p.learn(0.1, 0.065)
    p.learn(0.101, 0.065)
    assert p.level() == pytest.approx(0.036)  # the median of 0.061, 0.035, 0.036
    assert PauseShare(mode="share").predict(1.0) == 1.0
    with pytest.raises(ValueError, match="mode must be"):
        PauseShare(mode="sum")
    # a gap learnt against a slower schedule never takes more than half of a faster one
    q = PauseShare()
    for _ in range(3):
        q.learn(0.1, 0.3)
    assert q.predict(0.1) == pytest.approx(0.05)
