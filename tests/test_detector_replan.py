"""The detector across a plan change: keys whose work changed re-learn their calibration.

Synthetic, deterministic timings: every F (B = 2 F) op costs ``layers/tp · (α·tokens +
β·Σl²) + γ`` times a per-rank multiplier the test sets (1.7 for "the new layout runs
slower than its FLOPs say", 2.0 for a fail-slow device), with 1 % noise; the DP all-reduce
is a constant per rank times the same multiplier. Plans are 8 ranks TP2 x PP2 x DP2 on
one node, as ``resihp demo`` runs them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.detector.evidence import IterationTimings, batch_features
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import DeviceInfo, ExitEvent, HeartbeatEvent, PlanChange, TraceHeader

MODEL = preset("llama2-7b")
OLD = Plan.uniform(2, 2, 2, 32, 8)  # replicas [[0,1],[2,3]] and [[4,5],[6,7]], 4 micro-batches each
ALPHA, BETA, GAMMA, DP_S = 2e-6, 4e-11, 1e-4, 0.02
CHANGE = 20  # the first iteration under the new plan
K = DetectorConfig(adaptive=False).rewarm_iters
WINDOW_END = CHANGE + 1 + K  # the switch iteration is not learned from, then K iterations are


def _header(plan: Plan = OLD) -> TraceHeader:
    return TraceHeader(MODEL, plan, tuple(DeviceInfo(r, "node0", r) for r in range(8)), job="replan")


def _timings(det: Detector, it: int, mult: Mapping[int, float], dp_mult: Mapping[int, float] | None = None) -> IterationTimings:
    ix = det.index
    plan = ix.plan
    rng = np.random.default_rng(1000 + it)
    seqlens = tuple(
        tuple(tuple(int(x) for x in rng.integers(256, 4096, size=int(rng.integers(2, 6)))) for _ in range(rep.microbatches))
        for rep in plan.replicas
    )
    tok, ssq = batch_features(seqlens, ix.M)
    comp = np.full((ix.n, ix.V, 3, ix.M), np.nan)
    dp = np.full(ix.n, np.nan)
    for i, r in enumerate(ix.ranks):
        p = plan.position(r)
        rep = plan.replicas[p.replica]
        lo, hi = rep.layer_ranges()[p.stage]
        f = ((hi - lo) * (ALPHA * tok[p.replica] + BETA * ssq[p.replica]) / p.tp_size + GAMMA) * mult.get(r, 1.0)
        comp[i, 0, 0] = f
        comp[i, 0, 1] = 2 * f
        dp[i] = DP_S * (dp_mult or mult).get(r, 1.0)
    comp *= 1 + 0.01 * rng.standard_normal(comp.shape)
    dp *= 1 + 0.01 * rng.standard_normal(dp.shape)
    p2p = np.full((ix.n, ix.V, 2, ix.M), np.nan)
    time_s = float(np.nanmax(np.nansum(comp, axis=(1, 2, 3)) + dp))
    return IterationTimings(it, it * 10.0, time_s, seqlens, compute=comp, p2p=p2p, dp=dp)


def _run(det: Detector, first: int, last: int, mult: Mapping[int, float] | None = None,
         slow_from: Mapping[int, tuple[int, float]] | None = None) -> list[Finding]:
    """Iterations first..last-1; ``slow_from``: rank -> (from iteration, extra factor)."""
    out: list[Finding] = []
    for it in range(first, last):
        m = dict(mult or {})
        for r, (start, factor) in (slow_from or {}).items():
            if it >= start:
                m[r] = m.get(r, 1.0) * factor
        out += det.observe_timings(_timings(det, it, m), now=it * 10.0 + 5.0)
    return out


def _slow(found: list[Finding]) -> list[tuple[int, tuple[int, ...]]]:
    return [(f.iteration, f.ranks) for f in found if f.kind == "fail-slow"]


def _warm(det: Detector) -> None:
    assert _run(det, 0, CHANGE) == []


# the operator excluded rank 3: its replica becomes one TP2 stage holding every layer
# (new layer range for ranks 0, 1), rank 2 idles as a spare; replica 1 keeps its place
EXCLUDED = Plan(replicas=(PipelinePlan(((0, 1),), (32,), 4), OLD.replicas[1]), spares=(2,), epoch=1)
# dp-shares: same stages and layer ranges, but replica 0 now runs 2 micro-batches, replica 1 runs 6
SHARES = Plan(replicas=(replace(OLD.replicas[0], microbatches=2), replace(OLD.replicas[1], microbatches=6)), epoch=1)


def test_same_keys_new_share_slower_than_flops_no_false_alarm() -> None:
    # ranks 4-7 now run 6 micro-batches; on a shared CPU each op runs 1.7x slower than its
    # FLOPs say (the layer range, hence the cost key, is the same as before the change)
    new = {4: 1.7, 5: 1.7, 6: 1.7, 7: 1.7}
    control = Detector(_header(), DetectorConfig(adaptive=False))  # the plan change is never told: calibration carries over
    _warm(control)
    found = _run(control, CHANGE, CHANGE + 6, mult=new)
    assert sorted(r for _, ranks in _slow(found) for r in ranks) == [4, 5, 6, 7]  # the false alarm

    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(SHARES)
    rw_c, rw_m, _ = det.predictor.rank_rewarm()  # replica 1's compute and DP ring re-learn; replica 0's too
    assert rw_c.tolist() == rw_m.tolist() == [True] * 8
    assert _run(det, CHANGE, WINDOW_END, mult=new) == []  # the re-warm window
    assert _run(det, WINDOW_END, WINDOW_END + 20, mult=new) == []  # and after: the new times are the calibration
    assert set(det.suspects().values()) == {"healthy"}
    assert not det.predictor.rewarming  # keys no evidence uses (P2P on one node, OPT) left the window too


def test_exclusion_new_layer_range_first_iteration_unlike_the_rest() -> None:
    # ranks 0, 1 now hold all 32 layers; the switch iteration runs at the FLOPs-scaled time,
    # every later one 1.7x slower (the old detector learnt the new key from that first one)
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(EXCLUDED)
    found = _run(det, CHANGE, CHANGE + 1)
    found += _run(det, CHANGE + 1, WINDOW_END + 20, mult={0: 1.7, 1: 1.7})
    assert found == []
    assert {det.suspects()[r] for r in EXCLUDED.ranks()} == {"healthy"}


def test_changed_rank_slow_after_the_window_is_confirmed() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(SHARES)
    new = {4: 1.7, 5: 1.7, 6: 1.7, 7: 1.7}
    onset = WINDOW_END + 5
    found = _run(det, CHANGE, onset + 6, mult=new, slow_from={5: (onset, 2.0)})
    assert _slow(found) == [(onset + 1, (5,))]  # confirm_iters = 2: suspect at onset, slow at onset + 1
    f = next(f for f in found if f.kind == "fail-slow")
    assert f.factor == pytest.approx(2.0, rel=0.05)
    assert f.cause == "compute" and f.replica == 1


def test_unchanged_rank_slow_right_after_the_change_is_caught_at_once() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(EXCLUDED)  # replica 1 (ranks 4-7) keeps its place and work
    found = _run(det, CHANGE, CHANGE + 4, mult={0: 1.7, 1: 1.7}, slow_from={6: (CHANGE, 2.0)})
    assert _slow(found) == [(CHANGE + 1, (6,))]  # the usual latency: no re-warm for an unchanged key
    assert det.suspects()[6] == "slow"
    assert det.suspects()[0] == "healthy"


def test_changed_ranks_cannot_be_suspects_in_the_window() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(EXCLUDED)
    for it in range(CHANGE, WINDOW_END):
        assert det.observe_timings(_timings(det, it, {0: 3.0, 1: 3.0}), now=it * 10.0) == []
        assert det.suspects()[0] == "healthy"


def test_heartbeat_loss_and_exit_in_the_window_are_fail_stops() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False, heartbeat_timeout_s=10.0))
    _warm(det)
    det.set_plan(EXCLUDED)
    t = CHANGE * 10.0
    assert [det.observe(HeartbeatEvent(r, t), now=t) for r in range(8)] == [[]] * 8
    _run(det, CHANGE, CHANGE + 3, mult={0: 1.7, 1: 1.7})
    for r in (0, 4, 5, 6, 7):  # rank 1 (re-warming) goes silent
        assert det.observe(HeartbeatEvent(r, t + 6.0), now=t + 6.0) == []
    assert det.tick(t + 10.0) == []
    out = det.tick(t + 10.5)
    assert [(f.kind, f.ranks, f.cause) for f in out] == [("fail-stop", (1,), "heartbeat")]
    out = det.observe(ExitEvent(0, t + 11.0, -9), now=t + 11.0)
    assert [(f.kind, f.ranks, f.cause) for f in out] == [("fail-stop", (0,), "process-exit")]
    assert det.suspects()[0] == det.suspects()[1] == "dead"
    assert det.suspects()[4] == "healthy"


def test_confirmed_slow_rank_that_stays_in_place_keeps_its_finding() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]
    det.set_plan(EXCLUDED)  # rank 5's replica is unchanged
    found = _run(det, CHANGE, CHANGE + 12, mult={0: 1.7, 1: 1.7, 5: 2.0})
    assert found == [] and det.suspects()[5] == "slow"
    assert det.rank_speed()[5] == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("still_slow", [True, False])
def test_confirmed_slow_rank_that_moves_stays_slow_through_the_window(still_slow: bool) -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]
    det.set_plan(SHARES)  # dp-shares moves work off rank 5's replica: its keys re-warm
    mult = {4: 1.7, 5: 1.7 * (2.0 if still_slow else 1.0), 6: 1.7, 7: 1.7}
    found = _run(det, CHANGE, WINDOW_END, mult=mult)
    assert found == [] and det.suspects()[5] == "slow"  # not lost, not recovered, in the window
    found = _run(det, WINDOW_END, WINDOW_END + 8, mult=mult)
    if still_slow:  # it learnt its new place at healthy speed (its timings / its factor): still 2x
        assert found == [] and det.suspects()[5] == "slow"
        assert det.rank_speed()[5] == pytest.approx(0.5, rel=0.05)
    else:
        assert [(f.kind, f.ranks) for f in found] == [("recovered", (5,))]
        assert det.suspects()[5] == "healthy"


def test_confirmed_slow_rank_alone_in_its_place_learns_it_at_healthy_speed() -> None:
    # TP1: the slow rank has no healthy partner to teach its new key; its own times divided
    # by its confirmed factor do, so a device still 2x slow stays slow after the window
    tp1 = Plan.uniform(1, 2, 4, 32, 8)  # replicas [0,1] [2,3] [4,5] [6,7], 2 micro-batches each
    det = Detector(_header(tp1), DetectorConfig(adaptive=False))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]
    reps = list(tp1.replicas)
    reps[2] = replace(reps[2], microbatches=1)  # dp-shares: work off rank 5's replica
    reps[3] = replace(reps[3], microbatches=3)
    det.set_plan(replace(tp1, replicas=tuple(reps), epoch=1))
    mult = {4: 1.7, 5: 3.4, 6: 1.7, 7: 1.7}
    found = _run(det, CHANGE, WINDOW_END + 10, mult=mult)
    assert found == [] and det.suspects()[5] == "slow"
    assert det.rank_speed()[5] == pytest.approx(0.5, rel=0.05)
    assert {det.suspects()[r] for r in (0, 1, 2, 3, 4, 6, 7)} == {"healthy"}


def _priced_over_true_f(det: Detector, it: int, rank: int, mult: float = 1.0) -> float:
    """The detector's price for ``rank``'s forward ops of iteration ``it``'s batch over what
    they cost at ``mult`` (the mean over its micro-batches)."""
    ix = det.index
    t = _timings(det, it, {})
    tok, ssq = batch_features(t.seqlens, ix.M)
    i = ix.ranks.index(rank)
    p = ix.plan.position(rank)
    lo, hi = ix.plan.replicas[p.replica].layer_ranges()[p.stage]
    truth = ((hi - lo) * (ALPHA * tok[p.replica] + BETA * ssq[p.replica]) / p.tp_size + GAMMA) * mult
    priced = det.predictor.compute(tok, ssq)[i, 0, 0]
    have = np.isfinite(truth) & np.isfinite(priced)
    return float(np.mean(priced[have] / truth[have]))


# the same TP2 groups, the layers split 12 / 20 instead of 16 / 16: every key is new, and each
# is seeded from the old fit of its own TP size
SPLIT = Plan(replicas=tuple(replace(r, layers=(12, 20)) for r in OLD.replicas), epoch=1)
# replica 0 drops TP: ranks 0 and 2 run its stages alone (1 and 3 idle); seeds across TP sizes
NO_TP = Plan(replicas=(PipelinePlan(((0,), (2,)), (16, 16), 4), OLD.replicas[1]), spares=(1, 3), epoch=1)


def test_a_seed_of_its_own_tp_size_is_not_replaced_by_a_fit_of_the_cold_first_iterations() -> None:
    # the first three iterations after the switch run 2x slow (new buffers, cold caches),
    # then at the FLOPs model's speed: a fit of the window's first samples priced the new
    # keys 2x; the seed, scaled from the old fit, is right and stands until the window's fit
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(SPLIT)
    cold = {r: 2.0 for r in range(8)}
    _run(det, CHANGE, CHANGE + 4, mult=cold)  # the switch iteration, then three cold ones
    _run(det, CHANGE + 4, WINDOW_END - 1)
    assert det.predictor.rewarming  # still inside the window
    for r in (0, 2, 4, 6):
        assert _priced_over_true_f(det, WINDOW_END, r) == pytest.approx(1.0, abs=0.05)
    _run(det, WINDOW_END - 1, WINDOW_END + 5)
    assert not det.predictor.rewarming  # the window's robust fit (cold samples are its minority)
    for r in (0, 2, 4, 6):
        assert _priced_over_true_f(det, WINDOW_END + 5, r) == pytest.approx(1.0, abs=0.1)


def test_a_seed_across_tp_sizes_above_its_first_samples_is_rescaled_at_once() -> None:
    # on CPU a TP2 group ran 3-4x slower than FLOPs say: its TP1 replacement's seed, scaled
    # from the TP2 fit, reads 1 / 0.35 = 2.9x the real time. The very first learning
    # iteration (itself 1.5x cold) already shows the seed is too high: cold iterations only
    # ever read slow, so it is rescaled then, not after three iterations priced 2.9x
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(NO_TP)
    fast = {0: 0.35, 2: 0.35}
    _run(det, CHANGE, CHANGE + 1, mult=fast)  # the switch iteration teaches nothing
    assert _priced_over_true_f(det, CHANGE + 1, 0, 0.35) == pytest.approx(1 / 0.35, rel=0.1)  # the seed
    _run(det, CHANGE + 1, CHANGE + 2, mult={0: 0.35 * 1.5, 2: 0.35 * 1.5})  # the first learning iteration
    assert _priced_over_true_f(det, CHANGE + 2, 0, 0.35) == pytest.approx(1.5, rel=0.1)
    assert _priced_over_true_f(det, CHANGE + 2, 2, 0.35) == pytest.approx(1.5, rel=0.1)


def test_a_seed_across_tp_sizes_below_its_cold_first_samples_waits_for_three() -> None:
    # the other way the first samples prove nothing (a cold iteration reads slow): a seed
    # below them stands until three learning iterations, then is checked on all of them
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(NO_TP)
    slow_tp1 = {0: 3.0, 2: 3.0}
    _run(det, CHANGE, CHANGE + 2, mult=slow_tp1)
    assert _priced_over_true_f(det, CHANGE + 2, 0, 3.0) == pytest.approx(1 / 3.0, rel=0.1)
    _run(det, CHANGE + 2, CHANGE + 4, mult=slow_tp1)  # learning iterations 2 and 3
    assert _priced_over_true_f(det, CHANGE + 4, 0, 3.0) == pytest.approx(1.0, rel=0.1)


def test_readmitted_spare_rewarms_and_the_repeated_plan_change_record_restarts_nothing() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    _warm(det)
    det.set_plan(EXCLUDED)
    _run(det, CHANGE, WINDOW_END + 2, mult={0: 1.7, 1: 1.7})
    back = replace(OLD, epoch=2)  # rank 3 readmitted, rank 2 back from the spares: the first layout again
    start = WINDOW_END + 2
    det.set_plan(back)  # the engine's set_plan, then the same plan as a PlanChange record
    det.observe(PlanChange(start, back), now=start * 10.0)
    found = _run(det, start, start + 1 + K, mult={r: 1.3 for r in range(4)})
    assert found == []
    found = _run(det, start + 1 + K, start + 1 + K + 10, mult={r: 1.3 for r in range(4)})
    assert found == []


def test_iteration_only_evidence_rewarms_the_job_key() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))
    out: list[Finding] = []

    def it_only(it: int, mult: float) -> IterationTimings:
        t = _timings(det, it, {})
        tok, ssq = batch_features(t.seqlens, det.index.M)
        tot, sq = np.nansum(tok, axis=1), np.nansum(ssq, axis=1)
        d = int(np.argmax(sq))  # the replica with the most attention work sets the pace
        return IterationTimings(it, t.start_s, (0.5 + 4e-5 * tot[d] + 2e-9 * sq[d]) * mult, t.seqlens)

    for it in range(CHANGE):
        out += det.observe_timings(it_only(it, 1.0), now=it * 10.0)
    det.set_plan(EXCLUDED)
    for it in range(CHANGE, CHANGE + 30):
        out += det.observe_timings(it_only(it, 1.0 if it == CHANGE else 1.7), now=it * 10.0)
    assert out == []
    onset = CHANGE + 30
    for it in range(onset, onset + 3):
        out += det.observe_timings(it_only(it, 1.7 * 1.5), now=it * 10.0)
    assert [(f.kind, f.iteration, f.ranks) for f in out] == [("fail-slow", onset + 1, ())]


def test_rank_step_evidence_rewarms_the_changed_ranks_step_keys() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False))

    def steps(it: int, mult: Mapping[int, float]) -> IterationTimings:
        t = _timings(det, it, mult)
        assert t.compute is not None and t.dp is not None
        return IterationTimings(it, t.start_s, t.time_s, t.seqlens, rank_step=np.nansum(t.compute, axis=(1, 2, 3)) + t.dp)

    out: list[Finding] = []
    for it in range(CHANGE):
        out += det.observe_timings(steps(it, {}), now=it * 10.0)
    det.set_plan(EXCLUDED)
    new = {0: 1.7, 1: 1.7}
    for it in range(CHANGE, WINDOW_END + 10):
        out += det.observe_timings(steps(it, {**new, 6: 2.0} if it >= CHANGE + 1 else new), now=it * 10.0)
    # rank 6 (unchanged) is caught at once; ranks 0, 1 (new step keys) raise nothing
    assert [(f.kind, f.iteration, f.ranks, f.cause) for f in out] == [("fail-slow", CHANGE + 2, (6,), "unknown")]
    assert not det.predictor.rewarming


def test_rewarm_iters_is_validated() -> None:
    with pytest.raises(ValueError, match="rewarm_iters must be a positive integer"):
        DetectorConfig(adaptive=False, rewarm_iters=0)


# --- the planner's wording: an operator's exclusion is not a failure ---------------------------


def test_planner_names_excluded_ranks_as_excluded_not_failed() -> None:
    from resihp.coordinator.model.cluster import Cluster, GlobalBatch
    from resihp.coordinator.planner.planner import decide, search_plan

    spec, batch = preset("llama2-7b"), GlobalBatch(32, 4096)
    cluster = Cluster.uniform(4, 8)
    current = search_plan(cluster, spec, batch)
    d = decide(cluster.with_failed([9]), spec, batch, current, None, 0.0, excluded={9})
    assert d.act and 9 not in d.plan.ranks()
    assert d.reason.startswith("ranks [9] were excluded by the operator: the current plan cannot run"), d.reason
    assert "failed" not in d.reason
    d = decide(cluster.with_failed([9, 10]), spec, batch, current, None, 0.0, excluded={9})
    assert d.reason.startswith("ranks [10] have failed and ranks [9] were excluded by the operator"), d.reason
    d = decide(cluster.with_failed([9]), spec, batch, current, None, 0.0)  # no exclusion: a failure as before
    assert d.reason.startswith("ranks [9] have failed"), d.reason


def test_engine_tells_the_planner_which_unavailable_ranks_are_excluded() -> None:
    from resihp.coordinator.service.engine import build_header, make_engine

    plan = Plan.uniform(2, 2, 2, 8, 8)  # the demo's layout
    engine = make_engine("real", build_header(preset("gpt-tiny"), plan, 8, "job"))
    nodes = {r: "n0" for r in range(8)}
    d = engine.decide(plan, None, frozenset({3}), 0.0, nodes)  # what the operator's exclude --rank 3 asks
    assert d.act and not d.plan.has_rank(3)
    assert "ranks [3] were excluded by the operator" in d.reason and "failed" not in d.reason, d.reason
    engine.observe(ExitEvent(3, 1.0, -9), 1.0)  # now it is dead
    d = engine.decide(plan, None, frozenset({3}), 2.0, nodes)
    assert "ranks [3] have failed" in d.reason, d.reason


def test_confirmed_slow_rank_left_out_of_the_plan_stays_slow_until_readmitted() -> None:
    # nothing observes a spare: forgetting its verdict handed the still-throttled rank back to
    # the next re-plan as healthy (bench/e2e.py, 2026-11-30: the fail-stop's re-plan took the
    # 2x slow spare over three healthy ones)
    det = Detector(_header(), DetectorConfig(adaptive=False))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]
    alone = Plan(replicas=(replace(OLD.replicas[0], microbatches=8),), spares=(4, 5, 6, 7), epoch=1)
    det.set_plan(alone)
    assert _run(det, CHANGE, CHANGE + 4) == []
    assert det.suspects()[5] == "slow" and det.suspects()[4] == "healthy"
    assert det.rank_speed()[5] == pytest.approx(0.5, rel=0.05)
    assert det.compute_speed()[5] == pytest.approx(0.5, rel=0.05)
    assert 5 not in det.link_factor() and det.rank_speed().get(4, 1.0) == 1.0
    assert det.readmit(0) is False  # in the plan: it recovers through its own timings
    assert det.readmit(5) is True and det.readmit(5) is False
    assert det.suspects()[5] == "healthy" and det.rank_speed().get(5, 1.0) == 1.0
    det.set_plan(replace(OLD, epoch=2))  # back in the plan, judged afresh
    assert det.suspects()[5] == "healthy"


def test_slow_verdict_of_a_rank_out_of_the_plan_lapses_after_spare_verdict_s() -> None:
    det = Detector(_header(), DetectorConfig(adaptive=False, spare_verdict_s=100.0))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]  # at t = 135 s (_run: iteration i at 10 i + 5 s)
    det.set_plan(Plan(replicas=(replace(OLD.replicas[0], microbatches=8),), spares=(4, 5, 6, 7), epoch=1))
    _run(det, CHANGE, CHANGE + 3)  # up to t = 225 s: 90 s after the verdict
    assert det.rank_speed()[5] == pytest.approx(0.5, rel=0.05) and det.suspects()[5] == "slow"
    assert det.tick(230.0) == []
    _run(det, CHANGE + 3, CHANGE + 4)  # t = 235 s: the verdict has lapsed
    assert det.rank_speed().get(5, 1.0) == 1.0 and det.suspects()[5] == "healthy"
    assert det.readmit(5) is False  # nothing left to clear
    # the coordinator hears of it as a recovery (it re-plans on that), once
    back = det.tick(236.0)
    assert [(f.kind, f.ranks, f.stage) for f in back] == [("recovered", (5,), None)]
    assert "slow verdict lapsed 100 s after it was given" in back[0].reason
    assert back[0].evidence["verdict_age_s"] == pytest.approx(100.0)
    assert det.tick(237.0) == []


def _lapsed_then_taken_back(still_slow: bool) -> tuple[Detector, list[Finding]]:
    """Rank 5 found 2x slow, left idle until its verdict lapses, then taken back into its TP2
    group [4, 5] (new work: its keys re-warm) while its device is still 2x slow, or repaired."""
    det = Detector(_header(), DetectorConfig(adaptive=False, spare_verdict_s=100.0))
    assert _slow(_run(det, 0, CHANGE, slow_from={5: (12, 2.0)})) == [(13, (5,))]
    det.set_plan(Plan(replicas=(replace(OLD.replicas[0], microbatches=8),), spares=(4, 5, 6, 7), epoch=1))
    _run(det, CHANGE, CHANGE + 4)
    assert [(f.kind, f.ranks) for f in det.tick(236.0)] == [("recovered", (5,))]  # lapsed
    det.set_plan(replace(OLD, epoch=2))
    back = CHANGE + 4
    return det, _run(det, back, back + 1 + K + 8, mult={5: 2.0} if still_slow else {})


def test_a_rank_taken_back_after_its_verdict_lapsed_teaches_nothing_while_its_mate_can() -> None:
    # the median of a TP2 group is the mean of its two members: the still-slow rank taught its
    # key 1.5x, and its slowdown came out as a degraded DP-ring record, never as compute
    det, found = _lapsed_then_taken_back(still_slow=True)
    slow = [f for f in found if f.kind == "fail-slow"]
    assert [(f.ranks, f.cause) for f in slow] == [((5,), "compute")]
    assert slow[0].iteration <= CHANGE + 4 + 1 + K + 2  # the window, then confirm_iters
    assert slow[0].factor == pytest.approx(2.0, rel=0.05)
    assert not [f for f in found if f.kind == "degraded"]
    assert det.suspects()[5] == "slow" and det.suspects()[4] == "healthy"


def test_a_rank_taken_back_repaired_after_its_verdict_lapsed_stays_healthy() -> None:
    det, found = _lapsed_then_taken_back(still_slow=False)
    assert found == []
    assert set(det.suspects().values()) == {"healthy"}
    # judged normal for recover_iters iterations after its window: its fault is over, so its
    # lapse record ends (it teaches re-warming keys again, and lengthens no later verdict)
    assert 5 not in det._lapses


def test_a_rank_taken_back_still_slow_keeps_its_lapse_record_until_judged_normal() -> None:
    det, _ = _lapsed_then_taken_back(still_slow=True)
    assert 5 in det._lapses
    back = CHANGE + 4 + 1 + K + 8
    _run(det, back, back + DetectorConfig().recover_iters + 2)  # repaired: its timings recover it
    assert 5 not in det._lapses and det.suspects()[5] == "healthy"


def test_spare_verdict_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="spare_verdict_s must be > 0 seconds"):
        DetectorConfig(adaptive=False, spare_verdict_s=0.0)


@pytest.mark.parametrize("then, settles_at", [(1.5, 3.0), (0.75, 1.5)])
def test_a_slow_rank_whose_slowdown_moves_after_a_re_plan_is_reported_again_once(then: float,
                                                                                  settles_at: float) -> None:
    # rank 5 found 2x slow, the layout re-planned around it (dp-shares), then its slowdown
    # grows to 3x (a GPU heating up) or eases to 1.5x: the planner sized its work for 2x
    det = Detector(_header(), DetectorConfig(adaptive=False))
    found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
    assert _slow(found) == [(13, (5,))]
    det.set_plan(SHARES)
    mult = {4: 1.7, 5: 1.7 * 2.0, 6: 1.7, 7: 1.7}
    moved_at = WINDOW_END + 10
    found = _run(det, CHANGE, moved_at + 30, mult=mult, slow_from={5: (moved_at, then)})
    again = [f for f in found if f.kind == "fail-slow"]
    assert [f.ranks for f in again] == [(5,)], [(f.kind, f.ranks, f.iteration) for f in found]
    f = again[0]
    # both halves of the 8-iteration window past the step: at most 8 iterations after it
    assert moved_at + 4 <= f.iteration <= moved_at + DetectorConfig().factor_drift_iters
    assert f.factor == pytest.approx(settles_at, rel=0.05)
    assert f.evidence["reported_factor"] == pytest.approx(2.0, rel=0.05)
    assert "moved from 2.0" in f.reason and f"to {f.factor:.2f}x" in f.reason and f.cause == "compute"
    assert det.rank_speed()[5] == pytest.approx(1 / settles_at, rel=0.05)
    assert det.suspects()[5] == "slow"


def test_a_steady_slowdown_is_not_reported_again_and_factor_drift_0_follows_nothing() -> None:
    for drift in (0.3, 0.0):
        det = Detector(_header(), DetectorConfig(adaptive=False, factor_drift=drift))
        found = _run(det, 0, CHANGE, slow_from={5: (12, 2.0)})
        det.set_plan(SHARES)
        mult = {4: 1.7, 5: 1.7 * 2.0, 6: 1.7, 7: 1.7}
        found += _run(det, CHANGE, WINDOW_END + 60, mult=mult, slow_from={5: (WINDOW_END + 10, 1.5 if not drift else 1.0)})
        assert _slow(found) == [(13, (5,))], (drift, [(f.kind, f.ranks, f.iteration) for f in found])


@pytest.mark.parametrize("bad", [{"factor_drift": -0.1}, {"factor_drift": float("nan")}, {"factor_drift_iters": 1},
                                 {"factor_drift_iters": 2.5}, {"in_flight": "yes"}])
def test_factor_drift_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="DetectorConfig." + next(iter(bad))):
        DetectorConfig(**bad)  # type: ignore[arg-type]
