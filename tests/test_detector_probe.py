"""Idle ranks judged by their compute probes (coordinator/detector/probe.py).

The same synthetic 8-rank TP2 x PP2 x DP2 job as test_detector_replan.py: rank 5 turns 2x
slow at iteration 12, is found, and a re-plan leaves ranks 4-7 idle. Every rank probed once
at start-up (0.050 s, rank 5 then healthy); idle ranks then probe again at chosen times.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_detector_replan import CHANGE, OLD, _header, _run, _slow

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.detector.probe import ProbeBook
from resihp.coordinator.model.plan import Plan

PROBE_S = 0.050
ALONE = Plan(replicas=(replace(OLD.replicas[0], microbatches=8),), spares=(4, 5, 6, 7), epoch=1)


def _excluded(config: DetectorConfig | None = None) -> Detector:
    """Rank 5 confirmed 2x slow at t = 135 s, then left idle with ranks 4, 6, 7."""
    det = Detector(_header(), config or DetectorConfig(adaptive=False))
    for r in range(8):
        assert det.observe_probe(r, PROBE_S * (1 + 0.01 * (r % 3)), now=1.0) == []
    assert _slow(_run(det, 0, CHANGE, slow_from={5: (12, 2.0)})) == [(13, (5,))]
    det.set_plan(ALONE)
    return det


def _kinds(found: list[Finding]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(f.kind, f.ranks, f.cause) for f in found]


def test_a_slow_idle_rank_recovers_after_recover_iters_normal_probes() -> None:
    det = _excluded()
    k = det.config.recover_iters
    found = [f for i in range(k) for f in det.observe_probe(5, PROBE_S * 1.02, now=300.0 + i)]
    assert _kinds(found) == [("recovered", (5,), "compute")]
    assert "its last 3 compute probes ran at x1.01 of the other ranks'" in found[0].reason, found[0].reason
    assert found[0].evidence["reference_s"] == pytest.approx(PROBE_S * 1.01)
    assert det.suspects()[5] == "healthy" and det.rank_speed().get(5, 1.0) == 1.0


def test_one_slow_probe_breaks_the_run_of_normal_ones() -> None:
    det = _excluded()
    assert det.observe_probe(5, PROBE_S, now=300.0) == []
    assert det.observe_probe(5, PROBE_S, now=301.0) == []
    assert det.observe_probe(5, PROBE_S * 2, now=302.0) == []  # still slow after all
    assert det.observe_probe(5, PROBE_S, now=303.0) == []
    assert det.observe_probe(5, PROBE_S, now=304.0) == []
    assert det.suspects()[5] == "slow"
    assert _kinds(det.observe_probe(5, PROBE_S, now=305.0)) == [("recovered", (5,), "compute")]


def test_slow_probes_renew_the_verdict_so_it_does_not_lapse() -> None:
    det = _excluded(DetectorConfig(adaptive=False, spare_verdict_s=100.0))
    assert det.observe_probe(5, PROBE_S * 1.6, now=200.0) == []  # 65 s after the verdict: renewed
    assert det.tick(290.0) == []  # 155 s after the verdict, 90 s after the renewal: stands
    assert det.suspects()[5] == "slow"
    assert det.rank_speed()[5] == pytest.approx(1 / 1.6 * 1.01, rel=0.02)  # the probe's factor now
    back = det.tick(301.0)  # 101 s after the last slow probe, none since: lapses
    assert _kinds(back) == [("recovered", (5,), "unknown")]


def test_a_healthy_idle_rank_whose_probes_turn_slow_is_found() -> None:
    det = _excluded()
    assert det.observe_probe(6, PROBE_S * 1.5, now=300.0) == []  # one slow probe is no finding
    found = det.observe_probe(6, PROBE_S * 1.5, now=330.0)
    assert _kinds(found) == [("fail-slow", (6,), "compute")]
    assert found[0].factor == pytest.approx(1.5 / 1.01, rel=0.01) and found[0].stage is None
    assert "idle rank 6 is compute-slow: its last 2 compute probes" in found[0].reason
    assert det.rank_speed()[6] == pytest.approx(1.01 / 1.5, rel=0.01)


def test_a_rank_of_the_plan_only_refreshes_the_reference() -> None:
    det = _excluded()
    for t in range(5):
        assert det.observe_probe(0, PROBE_S * 3, now=300.0 + t) == []  # its iterations judge it
    assert det.suspects()[0] == "healthy"


def test_slow_and_dead_ranks_do_not_make_the_reference() -> None:
    book = ProbeBook()
    book.read(0, 0.05, set())
    book.read(1, 0.05, set())
    book.read(2, 0.20, set())
    got = book.read(3, 0.05, {2})
    assert got.reference_s == pytest.approx(0.05) and got.ratio == pytest.approx(1.0)
    alone = ProbeBook().read(0, 0.05, set())
    assert alone.ratio is None and alone.reference_s is None


def test_a_link_slow_idle_rank_is_left_to_the_lapse() -> None:
    det = _excluded()
    det._cause[5] = "communication"  # as if its finding had named its links
    for t in range(5):
        assert det.observe_probe(5, PROBE_S, now=300.0 + t) == []
    assert det.suspects()[5] == "slow"


@pytest.mark.parametrize("rank, probe_s, message", [
    (8, 0.05, "probe from rank 8: not a rank of this job (ranks 0..7)"),
    (-1, 0.05, "probe from rank -1: not a rank of this job"),
    (2, math.nan, "probe from rank 2: probe_s must be a finite duration > 0 seconds, got nan"),
    (2, -0.1, "probe_s must be a finite duration > 0 seconds, got -0.1"),
    (2, 0.0, "probe_s must be a finite duration > 0 seconds, got 0.0"),
    (2, math.inf, "got inf"),
])
def test_bad_probes_are_refused_and_change_nothing(rank: int, probe_s: float, message: str) -> None:
    det = _excluded()
    before = (det.suspects(), det.rank_speed(), dict(det._probes.latest))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        det.observe_probe(rank, probe_s, now=300.0)
    assert (det.suspects(), det.rank_speed(), dict(det._probes.latest)) == before


def test_probe_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="DetectorConfig.probe_threshold must be a relative excess"):
        DetectorConfig(adaptive=False, probe_threshold=0.0)


@pytest.mark.parametrize("was_slow, slow_probe, run, action", [
    (True, True, 1, "renew"), (True, False, 2, "none"), (True, False, 3, "recovered"),
    (False, True, 1, "none"), (False, True, 2, "fail-slow"), (False, False, 5, "none"),
])
def test_one_rule_for_the_detector_and_the_simulator(was_slow: bool, slow_probe: bool, run: int, action: str) -> None:
    from resihp.coordinator.detector.probe import is_slow_probe, judge_probe

    cfg = DetectorConfig(adaptive=False)  # confirm_iters 2, recover_iters 3, probe_threshold 0.10
    assert judge_probe(was_slow, slow_probe, run, cfg) == action
    assert is_slow_probe(1.11, cfg) and not is_slow_probe(1.10, cfg)


def _lapsed_then_found_again(gap_s: float) -> tuple[Detector, float]:
    """Rank 5's first verdict (t = 135 s) lapses at 235 s with no probe; its compute probes
    ``gap_s`` after the lapse find it slow again. Returns the detector and that verdict's time."""
    det = _excluded(DetectorConfig(adaptive=False, spare_verdict_s=100.0))
    assert _kinds(det.tick(236.0)) == [("recovered", (5,), "unknown")]
    k = det.config.confirm_iters
    found = [f for i in range(k) for f in det.observe_probe(5, PROBE_S * 2, now=235.0 + gap_s + i)]
    assert _kinds(found) == [("fail-slow", (5,), "compute")]
    return det, 235.0 + gap_s + k - 1


def test_a_verdict_that_lapsed_while_its_fault_went_on_holds_as_long_as_the_fault_has_lasted() -> None:
    det, given = _lapsed_then_found_again(50.0)  # the fault outlasted the lapse
    lasted = given - 135.0  # since its first verdict: 151 s
    assert det.tick(given + lasted - 1.0) == [] and det.suspects()[5] == "slow"  # past 100 s: still held
    back = det.tick(given + lasted + 1.0)
    assert _kinds(back) == [("recovered", (5,), "unknown")]
    assert "held as long as its fault had lasted" in back[0].reason, back[0].reason
    # and a third verdict of the same fault holds longer still: it has lasted longer
    k = det.config.confirm_iters
    third = [f for i in range(k) for f in det.observe_probe(5, PROBE_S * 2, now=given + lasted + 30.0 + i)]
    assert _kinds(third) == [("fail-slow", (5,), "compute")]
    given3 = given + lasted + 30.0 + k - 1
    assert det.tick(given3 + (given3 - 135.0) - 1.0) == []
    assert _kinds(det.tick(given3 + (given3 - 135.0) + 1.0)) == [("recovered", (5,), "unknown")]


def test_a_verdict_given_long_after_an_earlier_one_lapsed_holds_spare_verdict_s() -> None:
    det, given = _lapsed_then_found_again(300.0)  # a new fault, not the old one going on
    assert det.tick(given + 99.0) == []
    assert _kinds(det.tick(given + 101.0)) == [("recovered", (5,), "unknown")]


def test_normal_probes_end_the_longer_hold() -> None:
    det, given = _lapsed_then_found_again(50.0)
    k = det.config.recover_iters
    found = [f for i in range(k) for f in det.observe_probe(5, PROBE_S, now=given + 10.0 + i)]
    assert _kinds(found) == [("recovered", (5,), "compute")]  # evidence: the count is reset
    again = [f for i in range(det.config.confirm_iters) for f in det.observe_probe(5, PROBE_S * 2, now=given + 20.0 + i)]
    assert _kinds(again) == [("fail-slow", (5,), "compute")]
    assert _kinds(det.tick(given + 21.0 + 101.0)) == [("recovered", (5,), "unknown")]
