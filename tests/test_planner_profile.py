"""The planner's profile measured from healthy iterations (coordinator/planner/profile.py).

Records are synthesised from a known profile through the planner's own formulas
(coordinator/planner/cost.py: F and B FLOPs per op, two TP all-reduces per layer per op, one hop per
P2P, a ring per DP all-reduce, a memory-bound optimizer step); the fitter must give that
profile back. The engine tests check that only healthy iterations teach it and that the
policy switch decides which profile prices a plan.
"""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.costmodel import stage_flops
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import (
    ChunkTiming,
    DeviceInfo,
    ExitEvent,
    IterationRecord,
    PlanChange,
    Record,
    TraceHeader,
    read_trace,
    trace_tail,
    write_trace,
)
from resihp.coordinator.planner.cost import PlannerConfig, evaluate
from resihp.coordinator.planner.profile import UNBOUNDED_BW, Profile, ProfileFitter, _Transfer, fit_link

SPEC = preset("gpt-tiny")
TRUE = {"flops": 3.0e9, "bw": 40e6, "lat": 4e-4, "tp_lat": 2.5e-4, "hbm": 1.5e9}
INTRA_BW = 2e9
SEQS = ((30, 50, 48), (128,), (64, 64), (100, 28))


def _shard_params(plan: Plan, rank: int) -> float:
    d, s, _, k = plan.position_table()[rank]
    rep = plan.replicas[d]
    n = rep.layers[s] * SPEC.params_per_layer() + SPEC.embedding_params() * ((s == 0) + (s == rep.pp - 1))
    return n / k


def synth(plan: Plan, iteration: int, slow: dict[int, float] | None = None, prof: dict[str, float] = TRUE) -> IterationRecord:
    """One iteration's chunks as the planner's model says they take (``slow``: rank → factor
    on its compute)."""
    slow = slow or {}
    seqlens = tuple(tuple(SEQS[m % len(SEQS)] for m in range(rep.microbatches)) for rep in plan.replicas)
    chunks: list[ChunkTiming] = []
    for rank, (d, s, _, k) in sorted(plan.position_table().items()):
        rep = plan.replicas[d]
        t = 0.0
        for m in range(rep.microbatches):
            seq = seqlens[d][m]
            f = stage_flops(SPEC, seq, rep.layers[s], k, first=s == 0, last=s == rep.pp - 1)
            tokens = sum(seq)
            ring = 2 * (k - 1) / k * 2.0 * tokens * SPEC.hidden / INTRA_BW + 2 * (k - 1) * prof["tp_lat"]
            tp = 2 * rep.layers[s] * ring if k > 1 else 0.0
            hop = prof["lat"] + 2.0 * tokens * SPEC.hidden / prof["bw"]
            for kind, work in (("F", f.f), ("B", f.b + f.w)):
                if (kind == "F" and s > 0) or (kind == "B" and s < rep.pp - 1):
                    chunks.append(ChunkTiming(rank, "P2P", m, 0, t, t + hop))
                    t += hop
                span = work / prof["flops"] * slow.get(rank, 1.0) + tp
                chunks.append(ChunkTiming(rank, kind, m, 0, t, t + span))
                if tp:
                    chunks.append(ChunkTiming(rank, "TP", m, 0, t + span - tp, t + span))
                t += span
        params = _shard_params(plan, rank)
        if plan.dp > 1:
            n = plan.dp
            dp = 2 * (n - 1) * prof["lat"] + 2 * (n - 1) / n * params * 2.0 / prof["bw"]
            chunks.append(ChunkTiming(rank, "DP", -1, 0, t, t + dp))
            t += dp
        opt = params * 16.0 * 2.0 / prof["hbm"]
        chunks.append(ChunkTiming(rank, "OPT", -1, 0, t, t + opt))
    end = max(c.end_s for c in chunks)
    return IterationRecord(iteration, iteration * end, end, seqlens, tuple(chunks))


def fitter(plan: Plan) -> ProfileFitter:
    return ProfileFitter(SPEC, plan, intra_node_bw_Bps=INTRA_BW, inter_node_bw_Bps=2e9, inter_node_latency_s=8e-4)


def test_fit_recovers_the_profile_a_3d_job_ran_with() -> None:
    plan = Plan.uniform(2, 2, 2, SPEC.num_layers, 8)
    fit = fitter(plan)
    for i in range(10):
        fit.add(synth(plan, i))
    p = fit.profile()
    assert p.iterations == 10
    assert p.device_flops == pytest.approx(TRUE["flops"], rel=1e-9)
    assert p.link_bw_Bps == pytest.approx(TRUE["bw"], rel=1e-6)
    assert p.link_latency_s == pytest.approx(TRUE["lat"], rel=1e-6)
    assert p.tp_latency_s == pytest.approx(TRUE["tp_lat"], rel=1e-9)
    assert p.hbm_bw_Bps == pytest.approx(TRUE["hbm"], rel=1e-9)
    assert p.cluster_fields() == {"device_flops": p.device_flops, "inter_node_bw_Bps": p.link_bw_Bps,
                                  "inter_node_latency_s": p.link_latency_s, "intra_node_latency_s": p.tp_latency_s}
    assert "3 GFLOP/s" in p.describe() and "40 MB/s + 400 µs" in p.describe()


def test_samples_in_planner_units_stay_valid_across_plans() -> None:
    """Half the window on PP2×DP2, half on DP4: one profile (a re-plan does not restart it)."""
    a, b = Plan.uniform(1, 2, 2, SPEC.num_layers, 8), Plan.uniform(1, 1, 4, SPEC.num_layers, 8)
    fit = fitter(a)
    for i in range(5):
        fit.add(synth(a, i))
    fit.set_plan(b)
    for i in range(5, 10):
        fit.add(synth(b, i))
    p = fit.profile()
    assert p.device_flops == pytest.approx(TRUE["flops"], rel=1e-9)
    assert p.link_bw_Bps == pytest.approx(TRUE["bw"], rel=1e-6)
    assert p.link_latency_s == pytest.approx(TRUE["lat"], rel=1e-6)
    assert p.tp_latency_s is None  # no TP group ran: no evidence, the configured value stays


def test_one_outlier_iteration_does_not_move_the_profile() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    fit = fitter(plan)
    for i in range(9):
        fit.add(synth(plan, i))
    fit.add(synth(plan, 9, prof={**TRUE, "flops": TRUE["flops"] / 10, "bw": TRUE["bw"] / 10}))
    p = fit.profile()
    assert p.device_flops == pytest.approx(TRUE["flops"], rel=1e-9)
    assert p.link_bw_Bps == pytest.approx(TRUE["bw"], rel=1e-6)


def test_one_kind_of_transfer_scales_the_configured_line() -> None:
    """PP only: one message size cannot split latency from bandwidth; the configured line
    (2 GB/s, 0.8 ms) is scaled through the measured hop."""
    plan = Plan.uniform(1, 4, 1, SPEC.num_layers, 8)
    fit = fitter(plan)
    fit.add(synth(plan, 0))
    p = fit.profile()
    hops = {round(c.duration_s, 12) for c in synth(plan, 0).chunks if c.kind == "P2P"}
    assert len(hops) == 1  # packed micro-batches: one message size
    assert p.link_latency_s is not None and p.link_bw_Bps is not None
    assert p.link_latency_s + 2.0 * 128 * SPEC.hidden / p.link_bw_Bps == pytest.approx(hops.pop())
    assert p.link_latency_s * p.link_bw_Bps == pytest.approx(8e-4 * 2e9)  # the configured line, scaled


def test_in_node_p2p_prices_a_tp_group_the_job_has_not_run() -> None:
    """PP2 x DP2 with one pipeline inside a node: its P2P spans are the node's links, and with
    no TP span measured they price a TP all-reduce (the configured intra-node line, scaled
    through the measured hop). A pipeline across nodes teaches nothing about them; once TP
    spans are measured they price TP, as before; without the ranks' nodes nothing changes."""
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    hop = TRUE["lat"] + 2.0 * 128 * SPEC.hidden / TRUE["bw"]
    nodes = {0: "a", 1: "a", 2: "b", 3: "c"}
    fit = ProfileFitter(SPEC, plan, intra_node_bw_Bps=INTRA_BW, inter_node_bw_Bps=2e9, inter_node_latency_s=8e-4,
                        intra_node_latency_s=1e-5, nodes=nodes)
    for i in range(5):
        fit.add(synth(plan, i))
    p = fit.profile()
    assert p.intra_bw_Bps is not None and p.intra_latency_s is not None
    assert p.intra_latency_s + 2.0 * 128 * SPEC.hidden / p.intra_bw_Bps == pytest.approx(hop)
    assert p.intra_latency_s * p.intra_bw_Bps == pytest.approx(1e-5 * INTRA_BW)
    fields = p.cluster_fields()
    assert fields["intra_node_bw_Bps"] == p.intra_bw_Bps and fields["intra_node_latency_s"] == p.intra_latency_s
    assert "in-node links" in p.describe()
    # the planner now prices TP2 on those links: its all-reduces cost what the hops cost
    cfg = PlannerConfig()
    batch = GlobalBatch(8, 128)
    tp2 = Plan.uniform(2, 1, 2, SPEC.num_layers, 8)
    configured = Cluster.uniform(1, 4, device_flops=TRUE["flops"], intra_node_bw_Bps=INTRA_BW,
                                 intra_node_latency_s=1e-5)
    measured = Cluster.uniform(1, 4, device_flops=TRUE["flops"], intra_node_bw_Bps=fields["intra_node_bw_Bps"],
                               intra_node_latency_s=fields["intra_node_latency_s"])
    ring = 2.0 * 0.5 * 2.0 * 128 * SPEC.hidden / fields["intra_node_bw_Bps"] + 2.0 * fields["intra_node_latency_s"]
    extra = evaluate(tp2, measured, SPEC, batch, cfg).iteration_s - evaluate(tp2, configured, SPEC, batch, cfg).iteration_s
    assert extra > 0.5 * 4 * 4 * SPEC.num_layers * ring  # 4 micro-batches, 4 all-reduces per layer each
    # pipelines across nodes only: no in-node evidence
    apart = ProfileFitter(SPEC, plan, nodes={0: "a", 1: "b", 2: "c", 3: "d"})
    blind = ProfileFitter(SPEC, plan)
    for f in (apart, blind):
        f.add(synth(plan, 0))
        assert f.profile().intra_bw_Bps is None and "intra_node_bw_Bps" not in f.profile().cluster_fields()
    # TP spans measured: they price TP, the hops do not
    tp = Plan.uniform(2, 2, 1, SPEC.num_layers, 8)
    with_tp = ProfileFitter(SPEC, tp, intra_node_bw_Bps=INTRA_BW, nodes={r: "a" for r in range(4)})
    with_tp.add(synth(tp, 0))
    q = with_tp.profile()
    assert q.intra_bw_Bps is not None and q.tp_latency_s == pytest.approx(TRUE["tp_lat"], rel=1e-9)
    assert q.cluster_fields()["intra_node_latency_s"] == q.tp_latency_s
    assert "intra_node_bw_Bps" not in q.cluster_fields()


def test_fit_link_keeps_both_terms_non_negative() -> None:
    # bigger messages faster than small ones: no line with both terms >= 0; the better one-term fit
    pts = [_Transfer(1.0, 1e3, 2e-3), _Transfer(2.0, 1e6, 1e-3)]
    lat, bw = fit_link(pts, (8e-4, 2e9))  # type: ignore[misc]
    assert lat >= 0 and bw > 0
    assert lat == 0.0 or bw == UNBOUNDED_BW
    # the better of the two here: all latency, L = Σ(a/t) / Σ(a/t)² in relative least squares
    assert (lat, bw) == (pytest.approx((1 / 2e-3 + 2 / 1e-3) / ((1 / 2e-3) ** 2 + (2 / 1e-3) ** 2)), UNBOUNDED_BW)
    assert fit_link([], (8e-4, 2e9)) is None


def test_no_chunks_no_profile() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    fit = fitter(plan)
    rec = synth(plan, 0)
    fit.add(IterationRecord(0, 0.0, rec.time_s, rec.seqlens))
    assert fit.profile() == Profile()
    assert fit.profile().describe() == "no healthy iteration measured yet"
    with pytest.raises(ValueError, match="window must be >= 1"):
        ProfileFitter(SPEC, plan, window=0)


# --- the engine --------------------------------------------------------------------------------
def _engine(plan: Plan):  # type: ignore[no-untyped-def]
    from resihp.coordinator.service.engine_real import RealEngine

    header = TraceHeader(SPEC, plan, tuple(DeviceInfo(r, f"n{r}") for r in range(4)), tokens_per_microbatch=128)
    links = {"device_flops": 2e9, "intra_node_bw_Bps": INTRA_BW, "inter_node_bw_Bps": 2e9,
             "intra_node_latency_s": 8e-4, "inter_node_latency_s": 8e-4}
    return RealEngine(header, links=links)


def test_engine_learns_from_healthy_iterations_only() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    eng = _engine(plan)
    assert eng.policy()["profile"] == "measured"
    i = 0
    while i < 60 and eng.detector.all_healthy():
        eng.observe(synth(plan, i), now=float(i))
        i += 1
    healthy = eng.profile()
    assert healthy.device_flops == pytest.approx(TRUE["flops"], rel=1e-9)
    # rank 2 computes 4x slower: once the detector suspects it, nothing more is learned
    learned = [healthy.iterations]
    for j in range(i, i + 30):
        eng.observe(synth(plan, j, slow={2: 4.0}), now=float(j))
        learned.append(eng.profile().iterations)
    assert not eng.detector.all_healthy()
    assert learned[-1] <= learned[0] + 1  # at most the iteration that made it a suspect (far out, or suspect)
    assert eng.profile().device_flops == pytest.approx(TRUE["flops"], rel=1e-9)


def test_the_measured_profile_prices_plans_and_the_policy_can_turn_it_off() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    eng = _engine(plan)
    nodes = {r: f"n{r}" for r in range(4)}
    early = eng.decide(plan, None, frozenset({3}), 0.0, nodes)
    assert early.reason.endswith("[profile configured]")  # nothing measured yet
    for i in range(20):
        eng.observe(synth(plan, i), now=float(i))
    measured = eng.decide(plan, None, frozenset({3}), 20.0, nodes)
    assert "[profile measured over 20 healthy iterations: 3 GFLOP/s, links 40 MB/s + 400 µs" in measured.reason
    eng.set_policy({"profile": "configured"})
    assert eng.policy()["profile"] == "configured"
    assert eng.decide(plan, None, frozenset({3}), 20.0, nodes).reason.endswith("[profile configured]")
    with pytest.raises(ValueError, match="policy profile must be 'measured' .* or 'configured'"):
        eng.set_policy({"profile": "guessed"})
    assert eng.policy()["profile"] == "configured"  # a refused update changes nothing
    assert math.isfinite(TRUE["bw"])


def test_the_shares_policy_switches_the_planner_between_document_and_whole_shares() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    eng = _engine(plan)
    assert eng.policy()["shares"] == "documents" and eng.document_shares
    eng.set_policy({"shares": "whole"})
    assert eng.policy()["shares"] == "whole" and not eng.document_shares
    with pytest.raises(ValueError, match="policy shares must be 'documents' .* or 'whole'"):
        eng.set_policy({"shares": "halves"})
    assert eng.policy()["shares"] == "whole"  # a refused update changes nothing
    d = eng.decide(plan, None, frozenset({3}), 0.0, {r: f"n{r}" for r in range(4)})
    assert d.act and not d.plan.document_shares


# --- a restarted coordinator relearns the profile from the trace ------------------------------------
def _lines(header: TraceHeader, records: list[Record]) -> list[str]:
    buf = io.StringIO()
    write_trace(buf, header, records)
    return buf.getvalue().splitlines()


def test_trace_tail_keeps_the_header_the_plan_in_force_and_the_last_iterations() -> None:
    a, b = Plan.uniform(1, 2, 2, SPEC.num_layers, 8), Plan.uniform(1, 1, 4, SPEC.num_layers, 8)
    header = TraceHeader(SPEC, a, tuple(DeviceInfo(r, f"n{r}") for r in range(4)), tokens_per_microbatch=128)
    recs: list[Record] = [*(synth(a, i) for i in range(10)), PlanChange(10, b), *(synth(b, i) for i in range(10, 20)),
                          ExitEvent(3, 99.0, -9)]
    lines = _lines(header, recs)
    short = trace_tail(lines, 5)  # the plan change before the tail is kept: it is the plan in force
    assert short == [lines[0], lines[11], *lines[17:]]
    _, parsed = read_trace(short)
    got = list(parsed)
    assert isinstance(got[0], PlanChange) and got[0].plan == b
    assert [r.iteration for r in got if isinstance(r, IterationRecord)] == list(range(15, 20))
    assert isinstance(got[-1], ExitEvent)
    assert trace_tail(lines, 15) == [lines[0], *lines[6:]]  # from iteration 5: the change is inside
    assert trace_tail(iter(lines), 100) == lines  # streams
    assert trace_tail([], 3) == [] and trace_tail(["", "  "], 3) == []
    with pytest.raises(ValueError, match="max_iterations must be >= 1, got 0"):
        trace_tail(lines, 0)


def _same(got: Profile, want: Profile) -> bool:
    """Equal but for the trace's rounding of times to the nanosecond."""
    return got.iterations == want.iterations and all(
        getattr(got, f) == (None if getattr(want, f) is None else pytest.approx(getattr(want, f), rel=1e-6))
        for f in ("device_flops", "link_bw_Bps", "link_latency_s", "tp_latency_s", "hbm_bw_Bps"))


def test_a_restarted_engine_relearns_the_profile_from_the_job_trace() -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    live = _engine(plan)
    records: list[Record] = [synth(plan, i) for i in range(40)]
    for rec in records:
        assert isinstance(rec, IterationRecord)
        live.observe(rec, now=rec.start_s + rec.time_s)
    learnt = live.profile()
    assert learnt.iterations >= 30 and learnt.device_flops == pytest.approx(TRUE["flops"], rel=1e-9)
    lines = _lines(live.header, records)
    restarted = _engine(plan)
    assert restarted.profile().iterations == 0
    assert restarted.warm_start(lines) == learnt.iterations
    assert _same(restarted.profile(), learnt) and restarted.fitter.plan == plan
    # its first decision is priced with the measured profile, not the configured one
    decision = restarted.decide(plan, None, frozenset({3}), 0.0, {r: f"n{r}" for r in range(4)})
    assert f"[profile measured over {learnt.iterations} healthy iterations: 3 GFLOP/s" in decision.reason
    # a SIGKILLed coordinator can leave half a line: the records before it still count
    torn = _engine(plan)
    assert torn.warm_start([*lines, '{"type":"iteration","iteration":40,"sta']) == learnt.iterations
    assert _same(torn.profile(), learnt)
    # a trace that is not one (a damaged header) leaves the profile to be measured afresh
    broken = _engine(plan)
    assert broken.warm_start(["not json", *lines[1:]]) == 0 and broken.profile().iterations == 0
    from resihp.coordinator.service.engine import RuleEngine
    assert RuleEngine(live.header).warm_start(lines) == 0


# --- resihp profile (the CLI, a real subprocess) ---------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resihp.cli", "profile", *args], capture_output=True, text=True,
                          timeout=120)


def test_profile_cli_measures_a_trace_and_writes_a_cluster_file_for_resihp_plan(tmp_path: Path) -> None:
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    header = TraceHeader(SPEC, plan, tuple(DeviceInfo(r, f"n{r}") for r in range(4)), tokens_per_microbatch=128)
    trace = tmp_path / "trace.jsonl"
    with trace.open("w") as fh:
        write_trace(fh, header, [synth(plan, i) for i in range(30)])
    out = tmp_path / "cluster.json"
    done = _cli("--trace", str(trace), "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    prof = json.loads(done.stdout)
    assert prof["device_flops"] == pytest.approx(TRUE["flops"], rel=1e-6)
    assert prof["link_bw_Bps"] == pytest.approx(TRUE["bw"], rel=1e-6)
    assert prof["hbm_bw_Bps"] == pytest.approx(TRUE["hbm"], rel=1e-6)
    assert prof["healthy_iterations_seen"] == 30 and prof["iterations"] == 30
    cluster = Cluster.from_dict(json.loads(out.read_text()))
    assert cluster.device_flops == pytest.approx(TRUE["flops"], rel=1e-6)
    assert cluster.inter_node_latency_s == pytest.approx(TRUE["lat"], rel=1e-6)
    assert [(d.rank, d.node) for d in cluster.devices] == [(r, f"n{r}") for r in range(4)]
    # the file prices a plan with resihp plan
    current = tmp_path / "current.json"
    current.write_text(json.dumps(plan.to_dict()))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"preset": "gpt-tiny"}))
    planned = subprocess.run([sys.executable, "-m", "resihp.cli", "plan", "--cluster", str(out), "--model", str(model),
                              "--current", str(current), "--tokens-per-microbatch", "128", "--json"],
                             capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    # priced with the measured numbers: the current plan's time is the planner's evaluation on them
    batch = GlobalBatch(8, 128)
    expected = evaluate(plan, cluster, SPEC, batch, PlannerConfig()).iteration_s
    assert json.loads(planned.stdout)["predicted_iteration_s_before"] == pytest.approx(expected, rel=1e-9)


def test_profile_cli_says_what_is_wrong_with_its_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": 2}\n')
    done = _cli("--trace", str(bad))
    assert done.returncode == 2 and "resihp profile: error: line 1" in done.stderr and "format" in done.stderr
    plan = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    header = TraceHeader(SPEC, plan, tuple(DeviceInfo(r, f"n{r}") for r in range(4)))
    bare = tmp_path / "bare.jsonl"
    with bare.open("w") as fh:
        write_trace(fh, header, [IterationRecord(i, float(i), 1.0, synth(plan, 0).seqlens) for i in range(5)])
    done = _cli("--trace", str(bare))
    assert done.returncode == 2 and "no healthy iteration with chunk timings" in done.stderr, done.stderr
    done = _cli("--trace", str(bare), "--window", "0")
    assert done.returncode == 2 and "--window must be >= 1" in done.stderr


def test_the_engine_hands_the_planner_the_layouts_the_job_left() -> None:
    # A -> B -> C -> B: the planner is offered the layouts left, most recent first, never the
    # current one, at most EARLIER_PLANS of them
    from types import SimpleNamespace

    from resihp.coordinator.planner.decision import EARLIER_PLANS

    a = Plan.uniform(1, 2, 2, SPEC.num_layers, 8)
    b = Plan.uniform(1, 1, 4, SPEC.num_layers, 8)
    c = Plan.uniform(1, 4, 1, SPEC.num_layers, 8)
    eng = _engine(a)
    offered: list[tuple[Plan, ...]] = []
    real = eng._planner
    assert real is not None

    def decide(*args: object, earlier: tuple[Plan, ...] = (), **kw: object) -> object:
        offered.append(earlier)
        return real.decide(*args, earlier=earlier, **kw)

    eng._planner = SimpleNamespace(decide=decide, PlannerConfig=real.PlannerConfig)
    nodes = {r: f"n{r}" for r in range(4)}
    eng.decide(a, None, frozenset(), 0.0, nodes)
    for i, p in enumerate((b, c, b)):
        eng.set_plan(p, 10 * (i + 1))
        eng.decide(p, None, frozenset(), 0.0, nodes)
    layouts = [[q.replicas for q in got] for got in offered]
    assert layouts == [[], [a.replicas], [b.replicas, a.replicas], [c.replicas, a.replicas]] and EARLIER_PLANS == 2
