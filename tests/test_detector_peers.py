"""A device slow from the job's start (docs/detector.md, "Slow from the start"): a compute
baseline is learnt from the rank's own first iterations, so it held the slowdown and the rank
was never found. Ranks that do the same work anchor each other's baselines (adaptive.py:
peer_groups, anchor_to_peers). The pure parts, then the detector over generated traces."""
from __future__ import annotations

import numpy as np
import pytest
from test_detector import MODEL, _now

from resihp.coordinator.detector.adaptive import PEER_MIN, anchor_to_peers, peer_groups
from resihp.coordinator.detector.detector import Detector, Finding
from resihp.coordinator.detector.evidence import PlanIndex
from resihp.coordinator.detector.noise import NoiseModel
from resihp.coordinator.model.plan import Plan
from resihp.sim.workload import Fault, Noise, WorkloadConfig, make_header, records_list


def _groups(plan: Plan) -> list[list[int]]:
    ix = PlanIndex(plan)
    return sorted(sorted(ix.ranks[int(i)] for i in row if i >= 0) for row in peer_groups(ix.ckey))


def test_ranks_doing_the_same_work_are_peers_and_two_are_too_few() -> None:
    # TP2 x PP2 x DP2: a stage's TP members in both replicas do the same work
    assert _groups(Plan.uniform(2, 2, 2, 8, 4)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _groups(Plan.uniform(1, 2, 4, 8, 4)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # PP2 x DP2: two ranks per stage — either may be the slow one
    assert PEER_MIN == 3 and _groups(Plan.uniform(1, 2, 2, 8, 4)) == []


def _learnt(levels: list[float], spread: float, samples: int = 32) -> NoiseModel:
    """A noise model whose compute keys learnt ``samples`` healthy-looking ratios around each level."""
    rng = np.random.default_rng(3)
    nz = NoiseModel(range(len(levels)), kinds=2, min_samples=8)
    ok = np.ones((len(levels), 2), dtype=bool)
    for _ in range(samples):
        x = np.stack([np.asarray(levels) * (1.0 + spread * rng.standard_normal(len(levels))),
                      np.ones(len(levels))], axis=1)
        nz.test(x)
        nz.learn(x, ok)
    nz.learn(np.full((len(levels), 2), np.nan), ok)  # the warm-up's last refresh
    return nz


def test_a_baseline_far_above_its_peers_is_held_at_their_level() -> None:
    nz = _learnt([1.0, 1.0, 1.0, 1.5], spread=0.01)
    assert nz.m[3, 0] == pytest.approx(1.5, rel=0.02)
    groups = np.array([[0, 1, 2, 3]])
    held = anchor_to_peers(nz, groups, floor=0.05)
    assert held.tolist() == [False, False, False, True]
    assert nz.m[3, 0] == pytest.approx(1.05, rel=0.02)  # the peers' level and the effect floor
    assert nz.m[:3, 0] == pytest.approx([1.0, 1.0, 1.0], rel=0.02)


def test_a_held_baseline_keeps_its_relative_spread() -> None:
    """A device's jitter scales with its op times: held at its peers' level, a 2x rank's
    spread is what a healthy device there would show, not its own absolute one (kept absolute,
    it read 2x its peers' in units of the held baseline, and a 2x rank slow from the start on
    shared cores was found after 156 iterations)."""
    nz = _learnt([1.0, 1.0, 1.0, 2.0], spread=0.2)
    rel_before = nz.s[3, 0] / nz.m[3, 0]
    peers_s = nz.s[:3, 0].copy()
    assert anchor_to_peers(nz, np.array([[0, 1, 2, 3]]), floor=0.05)[3]
    assert nz.m[3, 0] < 1.6
    assert nz.s[3, 0] / nz.m[3, 0] == pytest.approx(rel_before, rel=1e-9)
    assert np.array_equal(nz.s[:3, 0], peers_s)


@pytest.mark.parametrize(("levels", "spread", "why"), [
    ([1.0, 1.0, 1.0, 1.04], 0.01, "under the effect floor"),
    ([1.0, 1.0, 1.0, 1.15], 0.20, "within its standard errors on noisy (shared) cores"),
])
def test_a_baseline_within_its_bound_is_left_alone(levels: list[float], spread: float, why: str) -> None:
    nz = _learnt(levels, spread)
    before = nz.m.copy()
    assert not anchor_to_peers(nz, np.array([[0, 1, 2, 3]]), floor=0.05).any(), why
    assert np.array_equal(nz.m, before)


def _run(plan: Plan, faults: tuple[Fault, ...], noise: Noise, iterations: int = 80) -> list[Finding]:
    cfg = WorkloadConfig(MODEL, plan, iterations=iterations, faults=faults, budget=8192, seed=11, noise=noise,
                         heartbeats=False)
    det = Detector(make_header(cfg))
    found: list[Finding] = []
    for rec in records_list(cfg):
        now = _now(rec)
        found += det.observe(rec, now) + det.tick(now)
    return found


@pytest.mark.parametrize(("plan", "rank", "factor"), [
    (Plan.uniform(1, 2, 4, 32, 8), 5, 1.3),
    (Plan.uniform(2, 2, 2, 32, 8), 6, 3.0),
])
def test_a_device_slow_from_the_first_iteration_is_found(plan: Plan, rank: int, factor: float) -> None:
    found = _run(plan, (Fault("compute", rank, 0, factor),), Noise())
    slow = [f for f in found if f.kind in ("fail-slow", "degraded")]
    assert slow and slow[0].ranks == (rank,) and slow[0].cause == "compute", found
    assert slow[0].iteration <= 30, slow[0]
    assert {r for f in slow for r in f.ranks} == {rank}, found


@pytest.mark.parametrize("plan", [Plan.uniform(1, 2, 4, 32, 8), Plan.uniform(2, 2, 2, 32, 8), Plan.uniform(1, 1, 8, 32, 8)])
def test_healthy_peers_anchor_nobody(plan: Plan) -> None:
    assert _run(plan, (), Noise(), iterations=200) == []
