"""The detector's default, noise-adaptive judging (coordinator/detector/noise.py) end to end:
generated traces through ``Detector.observe``. The fixed-threshold mode keeps its own tests
(test_detector.py and the others pin its exact iterations)."""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
from pathlib import Path

import pytest
import test_detector_replan as replan
from test_detector import PLAN, _cfg, _now, _replay

from resihp.coordinator.cli.detect import replay
from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.detector.paths import QuietPaths
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import IterationRecord, PlanChange, read_trace
from resihp.sim.workload import Fault, Hardware, Noise, make_header, records_list

ADAPTIVE = DetectorConfig()
DATA = Path(__file__).parent / "data"
# judged from iteration 16; a fault at 24 has eight healthy iterations of spread behind it
ONSET = ADAPTIVE.judged_from + 8
# paths inside a node are judged once 32 healthy readings, each 8 iterations old, show them
# quiet (coordinator/detector/paths.py, QuietPaths)
LATE = ADAPTIVE.judged_from + 48
NOISY = Noise(op_jitter=0.04, device_spread=0.02, drift=0.01, os_noise_prob=0.01, gc_prob=0.1, comm_jitter=0.15,
              comm_spike_prob=0.03)


def _slow(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.kind == "fail-slow"]


def test_adaptive_judging_is_the_default() -> None:
    assert ADAPTIVE.adaptive and ADAPTIVE.judged_from == ADAPTIVE.warmup_iters + ADAPTIVE.noise_min_samples
    assert not DetectorConfig(adaptive=False).judged_from > DetectorConfig(adaptive=False).warmup_iters


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_healthy_runs_raise_nothing(seed: int) -> None:
    """Jitter, GC pauses, data-loader stalls, congested transfers: 120 iterations, no finding;
    the fixed thresholds accuse somebody on the same trace (the reason for the default)."""
    cfg = _cfg(iterations=120, noise=NOISY, seed=seed)
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    assert found == []
    if seed == 1:
        _, fixed, _ = _replay(cfg, Detector(make_header(cfg), DetectorConfig(adaptive=False)))
        assert _slow(fixed), "the fixed thresholds found nothing either: this trace does not test the noise"


@pytest.mark.parametrize(("rank", "factor", "within"), [(5, 1.5, 3), (0, 2.0, 3), (7, 1.25, 3), (2, 1.1, 10)])
def test_a_compute_slowdown_is_found_on_its_rank(rank: int, factor: float, within: int) -> None:
    cfg = _cfg((Fault("compute", rank, ONSET, factor),), iterations=ONSET + 24, noise=Noise(), seed=7)
    _, found, states = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    slow = _slow(found)
    assert slow, "not found"
    first = slow[0]
    assert first.ranks == (rank,) and first.cause == "compute", first
    assert ONSET <= first.iteration < ONSET + within, first.iteration
    assert first.factor == pytest.approx(factor, rel=0.1)
    assert all(s[r] == "healthy" for s in states[:ONSET] for r in s)  # nothing before the fault


def test_a_slow_link_is_found_as_communication_on_its_rank() -> None:
    # two GPUs per node: every TP group is a node, every pipeline transfer crosses nodes
    cfg = _cfg((Fault("link", 4, ONSET, 3.0),), iterations=ONSET + 24, noise=Noise(), seed=3,
               hardware=Hardware(gpus_per_node=2))
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    slow = _slow(found)
    assert slow and slow[0].cause == "communication" and 4 in slow[0].ranks, slow
    assert slow[0].iteration < ONSET + 3


def _link_run(plan: Plan, faults: tuple[Fault, ...], per_node: int, iterations: int) -> tuple[list[Finding], list[Finding]]:
    """(the slow and degraded findings, every finding) of a quiet run of ``plan`` on nodes of
    ``per_node`` GPUs with ``faults``."""
    cfg = _cfg(faults, iterations=iterations, noise=Noise(), hardware=Hardware(gpus_per_node=per_node), plan=plan)
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    return [f for f in found if f.kind in ("fail-slow", "degraded")], found


def _on_links(got: list[Finding], found: list[Finding], ranks: list[tuple[int, ...]], onset: int, factor: float,
              rel: float = 0.15) -> None:
    """``got`` names ``ranks`` (one finding each), for communication, within 3 iterations of
    ``onset``, at ``factor``."""
    assert sorted(f.ranks for f in got) == ranks, [(f.iteration, f.kind, f.ranks) for f in found]
    assert all(f.cause == "communication" and f.iteration < onset + 3 for f in got), got
    assert all(f.factor == pytest.approx(factor, rel=rel) for f in got), [f.factor for f in got]


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_slow_path_between_two_stages_is_found_on_both_its_ends(factor: float) -> None:
    # PP2, two GPUs per node: the path between rank 2 (stage 1) and rank 0 (stage 0) carries
    # their activations and gradients both ways; their DP rings are healthy. Which end kept the
    # evidence was decided by the two healthy rings' noise, anew every iteration: a 5x path
    # costing 70 % of the iteration took 7-17 iterations to find
    got, found = _link_run(replan.OLD, (Fault("path", 2, ONSET, factor),), 2, ONSET + 16)  # TP2 x PP2 x DP2
    _on_links(got, found, [(0,), (2,)], ONSET, factor)


def test_a_slow_path_between_two_middle_stages_is_found_on_both_its_ends_and_recovered() -> None:
    # PP4 on two-GPU nodes: ranks 2 (stage 1) and 4 (stage 2) each have a second, healthy path
    # (to stages 0 and 3), which the smallest directional ratio read: the path never showed
    got, found = _link_run(Plan.uniform(2, 4, 2, 32, 16), (Fault("path", 2, ONSET, 3.0, end_iter=ONSET + 12),), 2,
                           ONSET + 40)
    _on_links(got, found, [(2,), (4,)], ONSET, 3.0, rel=0.1)
    back = [f for f in found if f.kind == "recovered"]
    assert sorted(f.ranks for f in back) == [(2,), (4,)] and all(f.iteration >= ONSET + 12 for f in back), back


def test_a_slow_path_inside_a_node_is_found_on_both_its_ends() -> None:
    # PP4 on four-GPU nodes: stages 0 and 1 of a replica share a node, so the path between
    # ranks 0 and 2 never leaves it (a degraded NVLink / PCIe link). Only cross-node transfers
    # were evidence: the path was never found (bench/outsider_traces.py). Rank 2 also talks to
    # stage 2 on the other node, whose healthy path the smallest ratio read; rank 0 talks inside
    # its node only and was judged on its DP ring alone
    # (a path inside a node is judged once its healthy readings show it quiet: LATE)
    plan = Plan.uniform(2, 4, 2, 32, 16)
    for factor in (1.5, 3.0):
        got, found = _link_run(plan, (Fault("path", 0, LATE, factor),), 4, LATE + 16)
        _on_links(got, found, [(0,), (2,)], LATE, factor)
    # and the path test leaves a slow NIC to its own rule: rank 4's cross-node paths, its
    # intra-node one healthy, name rank 4 and not its neighbour across the node boundary
    got, found = _link_run(plan, (Fault("link", 4, LATE, 3.0),), 4, LATE + 16)
    assert got and all(4 in f.ranks and 2 not in f.ranks for f in got), [(f.iteration, f.kind, f.ranks) for f in found]


def test_a_slow_path_of_a_replica_inside_one_node_names_its_two_ends_and_they_recover() -> None:
    # TP4 x PP2 on eight-GPU nodes: each replica in one node, every pipeline transfer inside it,
    # so every rank was judged on its DP ring alone and the slow path between ranks 1 (stage 0)
    # and 5 (stage 1) was never found. Each end is named alone, for its P2P, not with its ring
    plan = Plan.uniform(4, 2, 2, 32, 8)
    got, found = _link_run(plan, (Fault("path", 1, LATE, 3.0, end_iter=LATE + 12),), 8, LATE + 40)
    _on_links(got, found, [(1,), (5,)], LATE, 3.0)
    assert all("P2P link" in f.reason and "DP ring of" not in f.reason for f in got), [f.reason for f in got]
    back = [f for f in found if f.kind == "recovered"]
    assert sorted(f.ranks for f in back) == [(1,), (5,)] and all(f.iteration >= LATE + 12 for f in back), back
    # a slow NIC of that layout still slows whole DP rings, named whole (their members look alike)
    got, found = _link_run(plan, (Fault("link", 9, LATE, 3.0),), 8, LATE + 16)
    assert got and any(f.ranks == (1, 9) for f in got), [(f.iteration, f.kind, f.ranks) for f in found]


def test_a_slow_nic_names_its_own_nodes_ring_members_not_the_other_nodes() -> None:
    # TP2 x PP4 x DP2 on four-GPU nodes: node n2 (ranks 8-11) has a 4x NIC. Ranks 8 and 9
    # (stage 0) talk inside their node only, so their rings [0, 8] and [1, 9] were named whole;
    # ranks 10 and 11 also talk across nodes, where their P2P shows the NIC: the rings' members
    # on n2 are the culprits, ranks 0 and 1 (node n0) are not named
    faults = tuple(Fault("link", r, ONSET, 4.0) for r in (8, 9, 10, 11))
    got, found = _link_run(Plan.uniform(2, 4, 2, 32, 16), faults, 4, ONSET + 16)
    _on_links(got, found, [(8,), (9,), (10, 11)], ONSET, 4.0)
    assert all("NIC" in f.reason for f in got if f.ranks in ((8,), (9,))), [f.reason for f in got]


def test_loud_paths_inside_a_node_are_not_judged() -> None:
    """A real healthy run (tests/data: `bench/real_runs.py`'s PP2 x DP2 under `resihp launch`
    on 2 shared CPU cores, 150 iterations, 2026-12-07): every pipeline transfer stays inside a
    "node" of loopback, where healthy transfers burst to several times their model, both ways,
    for iterations on end. Judged, the run was accused (every healthy PP2 x DP2 run was, live);
    the quiet-path gate keeps them out."""
    with gzip.open(DATA / "real_pp2dp2_healthy_loopback.trace.jsonl.gz", "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()

    def p2p_findings() -> list[tuple[int, str, tuple[int, ...]]]:
        out = io.StringIO()
        replay(io.StringIO("\n".join(lines)), out, ADAPTIVE)
        found = [json.loads(x) for x in out.getvalue().splitlines()]
        return [(f["iteration"], f["kind"], tuple(f["ranks"])) for f in found if "P2P link" in f["reason"]]

    assert p2p_findings() == []
    # the gate is what judged them: paths inside a node read loud (beyond the bar in more than
    # LOUD of their healthy iterations) once seen for half a window. (Judged anyway, they
    # accused the run live; the re-plans that followed now let the moved keys learn their new
    # noise at once, which quietens them too: this trace no longer shows that by itself.)
    header, records = read_trace(io.StringIO("\n".join(lines)))
    det = Detector(header, ADAPTIVE)
    gated, now = 0, 0.0
    for rec in records:
        now = now if isinstance(rec, PlanChange) else _now(rec)
        det.observe(rec, now)
        det.tick(now)
        gate = det._quiet_paths  # pyright: ignore[reportPrivateUsage]
        gated = max(gated, int(((gate.seen >= QuietPaths.WINDOW // 2) & (gate.loud > QuietPaths.LOUD * gate.seen)).sum()))
    assert gated >= 2, "no path was loud: this trace does not test the gate"


def test_a_transient_slowdown_is_found_and_then_recovered() -> None:
    cfg = _cfg((Fault("compute", 3, ONSET, 2.0, end_iter=ONSET + 10),), iterations=ONSET + 40, noise=Noise())
    _, found, states = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    kinds = [(f.kind, f.ranks) for f in found]
    assert kinds == [("fail-slow", (3,)), ("recovered", (3,))], kinds
    rec = next(f for f in found if f.kind == "recovered")
    # recovered once the recent window (8 iterations) is back at the baseline, for recover_iters
    assert ONSET + 10 <= rec.iteration <= ONSET + 10 + 8 + ADAPTIVE.recover_iters + 2, rec.iteration
    assert states[-1][3] == "healthy"


def test_a_single_long_stall_is_no_fault() -> None:
    """One 3x iteration of one rank (a GC pause, a checkpoint): clipped, never a finding."""
    cfg = _cfg((Fault("compute", 6, ONSET, 3.0, end_iter=ONSET + 1),), iterations=ONSET + 30, noise=Noise())
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    assert found == []


def test_a_plan_change_does_not_blind_the_detector() -> None:
    """After the plan changes, ranks that moved start from their old spread, the others keep
    their windows: a slowdown of an unmoved rank right after the change is still found."""
    cfg = _cfg((Fault("compute", 1, ONSET + 2, 2.0),), iterations=ONSET + 20, noise=Noise())
    det = Detector(make_header(cfg), ADAPTIVE)
    found: list[Finding] = []
    for rec in records_list(cfg):
        if isinstance(rec, IterationRecord):
            if rec.iteration == ONSET:
                det.set_plan(PLAN)  # the same layout, announced: every rank re-warms its keys
            found += det.observe(rec, rec.start_s + rec.time_s)
    slow = _slow(found)
    assert slow and slow[0].ranks == (1,), found
    assert slow[0].iteration <= ONSET + 2 + ADAPTIVE.rewarm_iters + 3, slow[0].iteration


@pytest.mark.parametrize("still_slow", [True, False])
def test_a_slow_rank_that_moves_stays_slow_until_its_new_windows_say_otherwise(still_slow: bool) -> None:
    """A plan change empties a moved rank's windows; an empty window reads as no deviation,
    which must not count as recovered (seen live: a 1.3x-throttled rank "recovered" right after
    the re-plan that moved it, and the next re-plan used it again)."""
    change = 40
    det = Detector(replan._header(), ADAPTIVE)
    slow = [(f.iteration, f.ranks) for f in replan._run(det, 0, change, slow_from={5: (ONSET, 2.0)})
            if f.kind == "fail-slow"]
    assert slow and slow[0][1] == (5,) and slow[0][0] < ONSET + 3, slow
    det.set_plan(replan.SHARES)  # dp-shares moves work off rank 5's replica: its keys re-warm
    mult = {4: 1.7, 5: 1.7 * (2.0 if still_slow else 1.0), 6: 1.7, 7: 1.7}
    found = replan._run(det, change, change + 30, mult=mult)
    if still_slow:
        assert found == [] and det.suspects()[5] == "slow"
    else:
        assert [(f.kind, f.ranks) for f in found] == [("recovered", (5,))]
        assert found[0].iteration > change + det.config.rewarm_iters


def test_a_slowdown_that_starts_before_its_key_is_judged_is_still_found() -> None:
    """A key learns its first samples at once; one whose slowdown begins while it is still
    learning them (a fault at iteration 14, judged from 16) must keep learning until it can be
    judged — held back as 'leaning' it never reached its eighth sample and was never judged."""
    start = ADAPTIVE.warmup_iters + ADAPTIVE.noise_min_samples - 2
    cfg = _cfg((Fault("compute", 5, start, 3.0),), iterations=start + 20, noise=Noise.quiet(), seed=2)
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    slow = _slow(found)
    assert slow and slow[0].ranks == (5,) and slow[0].iteration <= ADAPTIVE.judged_from + 3, slow


@pytest.mark.parametrize(("rank", "factor", "noise"), [(5, 2.0, Noise()), (0, 3.0, NOISY), (7, 1.6, Noise())])
def test_a_severe_compute_slowdown_is_found_at_its_second_iteration(rank: int, factor: float, noise: Noise) -> None:
    """Every op of the rank slower by half or more, two iterations in a row: found at the second
    (the three-in-a-row jump would wait for a third iteration at the fault's full cost)."""
    cfg = _cfg((Fault("compute", rank, ONSET, factor),), iterations=ONSET + 12, noise=noise, seed=7)
    _, found, _ = _replay(cfg, Detector(make_header(cfg), ADAPTIVE))
    slow = _slow(found)
    assert slow and slow[0].ranks == (rank,) and slow[0].cause == "compute", found
    assert slow[0].iteration == ONSET + 1, slow[0].iteration
    assert slow[0].factor == pytest.approx(factor, rel=0.1)


def _stall_ops(rec: IterationRecord, rank: int, ops: int, extra_s: float) -> IterationRecord:
    """``rec`` with the first ``ops`` F ops of ``rank`` each ``extra_s`` longer (a GC pause, a
    page-fault storm: the op is stalled, the device is not slower)."""
    out, left = [], ops
    for c in rec.chunks:
        if c.rank == rank and c.kind == "F" and left > 0:
            c = dataclasses.replace(c, end_s=c.end_s + extra_s)
            left -= 1
        out.append(c)
    return dataclasses.replace(rec, chunks=tuple(out))


def test_stalled_ops_in_two_iterations_in_a_row_are_no_severe_slowdown() -> None:
    """Two stalled ops of one rank in each of two consecutive iterations lift its ratio of sums
    far beyond 1.5x twice (the trimmed ratio drops only the worst op), but its fastest op is
    untouched: not every op is slower, so this is no device, and nothing is found."""
    cfg = _cfg(iterations=ONSET + 12, noise=Noise(), seed=7)
    det = Detector(make_header(cfg), ADAPTIVE)
    found: list[Finding] = []
    far = []
    for rec in records_list(cfg):
        stalled = isinstance(rec, IterationRecord) and rec.iteration in (ONSET, ONSET + 1)
        if isinstance(rec, IterationRecord) and stalled:
            rec = _stall_ops(rec, 6, 2, rec.time_s)
        found += det.observe(rec, _now(rec))
        if stalled:  # the ratio of sums did read the two stalls as a severe slowdown of rank 6
            far.append(bool(det.noise.far[det.index.ranks.index(6), 0]))
    assert far == [True, True]
    assert found == []


def test_an_unchanged_replica_is_not_judged_slow_while_its_peers_rewarm() -> None:
    """A dp-shares change gives replica 0 a fifth micro-batch: its ranks' keys re-warm and
    only replica 1's two ranks have compute evidence, too few for the iteration's own common
    factor. All four ranks had run 1.5x the model for ten iterations (a load common to the
    host, which the calibration had not yet taken in): the remembered common factor keeps
    dividing it away. With a factor of 1 there, rank 2 or 3 was found 1.5x slow at the change
    (the real run's dp-shares re-plan for a throttled peer: a false finding and a re-plan)."""
    def run(det: Detector, first: int, last: int, mult: dict[int, float]) -> list[Finding]:
        return [f for it in range(first, last)  # the load slows compute; the DP rings keep their speed
                for f in det.observe_timings(replan._timings(det, it, mult, dp_mult={-1: 1.0}), now=it * 10.0 + 5.0)]

    plan = Plan.uniform(1, 2, 2, 32, 8)  # replicas [[0], [1]] and [[2], [3]], 4 micro-batches each
    header = dataclasses.replace(replan._header(plan), devices=replan._header(plan).devices[:4])
    det = Detector(header, ADAPTIVE)
    change = 90
    load = {r: 1.5 for r in range(4)}
    assert run(det, 0, change - 10, {}) == []
    assert run(det, change - 10, change, mult=load) == []
    shares = dataclasses.replace(plan, epoch=1, replicas=(
        dataclasses.replace(plan.replicas[0], microbatches=5), plan.replicas[1]))
    det.set_plan(shares)
    found = run(det, change, change + 12, mult=load)
    assert [f for f in found if f.kind in ("fail-slow", "degraded")] == []
    # and a real slowdown of rank 2 in that window is still found
    det2 = Detector(header, ADAPTIVE)
    run(det2, 0, change - 10, {})
    run(det2, change - 10, change, mult=load)
    det2.set_plan(shares)
    found = run(det2, change, change + 12, mult={**load, 2: 1.5 * 2.0})
    slow = _slow(found)
    assert slow and slow[0].ranks == (2,), found
