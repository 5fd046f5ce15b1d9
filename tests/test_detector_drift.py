"""FactorDrift (coordinator/detector/drift.py): a slow rank's factor followed after its finding."""
from __future__ import annotations

import pytest

from resihp.coordinator.detector.drift import FactorDrift


def _feed(d: FactorDrift, rank: int, ratios: list[float]) -> list[tuple[int, float]]:
    """(index, new factor) of each report; each report also names the factor it moved from."""
    out = []
    for k, x in enumerate(ratios):
        was = d.reported.get(rank)
        got = d.push(rank, x)
        if got is not None:
            assert got[0] == was
            out.append((k, got[1]))
    return out


def test_a_step_is_reported_once_at_its_new_level_when_both_halves_moved() -> None:
    d = FactorDrift(0.3, 8)
    d.start(3, 2.0)
    got = _feed(d, 3, [2.0] * 10 + [3.0] * 12)
    # the window [2, 3, 3, 3 | 3, 3, 3, 3] (k = 16): most of each half >= 2.6 (at k = 15 the
    # older half [2, 2, 3, 3] is only half)
    assert got == [(16, 3.0)]
    assert d.reported[3] == 3.0


def test_an_easing_slowdown_is_reported_down_but_an_ended_one_is_left_to_recovery() -> None:
    d = FactorDrift(0.3, 8)
    d.start(1, 3.0)
    assert _feed(d, 1, [1.5] * 8) == [(7, 1.5)]
    d.start(1, 2.0)
    assert _feed(d, 1, [1.02, 0.98, 1.1, 1.0] * 6) == []  # back to healthy speed: no "moved to 1.0x"


def test_noise_and_moves_under_the_share_are_not_reported() -> None:
    d = FactorDrift(0.3, 8)
    d.start(0, 1.3)
    # a 1.3x rank on shared cores: single iterations from 1.1 to 1.7, the median stays near 1.3
    swings = [1.1, 1.7, 1.25, 1.45, 1.2, 1.6, 1.3, 1.15] * 6
    assert _feed(d, 0, swings) == []
    assert _feed(d, 0, [1.6] * 16) == []  # 1.6 / 1.3 = 1.23 < 1.3


def test_a_burst_that_fills_one_half_alone_does_not_report() -> None:
    d = FactorDrift(0.3, 8)
    d.start(0, 2.0)
    assert _feed(d, 0, [2.0] * 8 + [4.0] * 5 + [2.0] * 8) == []  # 5 of 8: never 3 of 4 in both halves


def test_nothing_is_followed_without_a_finding_with_share_0_or_from_bad_ratios() -> None:
    d = FactorDrift(0.3, 4)
    assert _feed(d, 7, [5.0] * 8) == []  # never reported slow
    d.start(7, 2.0)
    assert _feed(d, 7, [float("nan"), float("inf"), -1.0, 0.0] * 3) == []
    off = FactorDrift(0.0, 4)
    off.start(7, 2.0)
    assert _feed(off, 7, [5.0] * 8) == []


def test_stop_and_new_plan_forget_what_they_should() -> None:
    d = FactorDrift(0.3, 4)
    d.start(2, 2.0)
    _feed(d, 2, [3.0] * 3)
    d.new_plan()  # the old layout's ratios are not compared with the new one's
    assert _feed(d, 2, [3.0] * 3) == []
    assert _feed(d, 2, [3.0]) == [(0, 3.0)]
    d.stop(2)
    assert 2 not in d.reported and _feed(d, 2, [9.0] * 8) == []


def test_a_window_needs_two_halves() -> None:
    with pytest.raises(ValueError, match="iters must be >= 2"):
        FactorDrift(0.3, 1)
