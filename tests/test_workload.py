"""The workload generator: real documents, packing, ground truth, faults, trace output."""
from __future__ import annotations

import io
import statistics

import numpy as np
import pytest

from resihp.coordinator.model.plan import Plan, Schedule
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import ExitEvent, HeartbeatEvent, IterationRecord, read_trace, write_trace
from resihp.sim.workload import (
    BatchStream,
    Fault,
    Noise,
    WorkloadConfig,
    make_header,
    records_list,
    stdlib_document_lengths,
)
from resihp.sim.workload_truth import GroundTruth

MODEL = preset("llama2-7b")


def test_documents_are_the_stdlib_sources() -> None:
    lengths = stdlib_document_lengths()
    assert len(lengths) > 500
    assert min(lengths) > 0 and max(lengths) > 32768  # real spread: tiny files to huge modules
    assert stdlib_document_lengths() == lengths


@pytest.mark.parametrize("method", ["greedy", "best-fit"])
@pytest.mark.parametrize("budget", [8192, 16384, 32768])
def test_packing_respects_the_budget_and_is_seeded(method: str, budget: int) -> None:
    a = BatchStream(budget, method, seed=3).take(200)
    b = BatchStream(budget, method, seed=3).take(200)
    c = BatchStream(budget, method, seed=4).take(200)
    assert a == b and a != c
    assert all(0 < sum(mb) <= budget for mb in a)
    assert any(len(mb) == 1 and mb[0] == budget for mb in a)  # long files fill a whole budget


def test_best_fit_packs_tighter_than_greedy() -> None:
    fill = {m: statistics.mean(sum(mb) for mb in BatchStream(32768, m, seed=1).take(300)) for m in ("greedy", "best-fit")}
    assert fill["best-fit"] > fill["greedy"]
    with pytest.raises(ValueError, match="packing method"):
        BatchStream(1024, "random")


def test_chunk_timings_follow_the_pipeline_schedule() -> None:
    plan = Plan.uniform(2, 4, 1, 32, 4)
    cfg = WorkloadConfig(MODEL, plan, budget=8192, seed=1, iterations=2, noise=Noise.quiet(), heartbeats=False)
    rec = next(r for r in records_list(cfg) if isinstance(r, IterationRecord))
    by = {(c.rank, c.kind, c.microbatch): c for c in rec.chunks if c.kind in ("F", "B")}
    for m in range(4):
        for s in range(3):  # activations flow forward, with a P2P hop in between
            assert by[(2 * (s + 1), "F", m)].start_s >= by[(2 * s, "F", m)].end_s
            assert by[(2 * s, "B", m)].start_s >= by[(2 * (s + 1), "B", m)].end_s
        assert by[(6, "B", m)].start_s >= by[(6, "F", m)].end_s
    p2p = [c for c in rec.chunks if c.kind == "P2P"]
    assert len(p2p) == 2 * 3 * 2 * 4  # 2 TP members x 3 hops x 2 directions x 4 micro-batches
    opt_end = max(c.end_s for c in rec.chunks if c.kind == "OPT")
    assert rec.time_s == pytest.approx(opt_end)


def _first_op(truth: GroundTruth, iteration: int) -> float:
    compute = truth.timings(iteration, 0.0).compute
    assert compute is not None
    return float(compute[0, 0, 0, 0])


def test_healthy_ops_repeat_to_about_a_percent() -> None:
    plan = Plan.uniform(1, 1, 1, 32, 1)
    docs = (4096, 4096)  # every micro-batch is the same: one 8K budget of two 4K documents
    cfg = WorkloadConfig(MODEL, plan, budget=8192, seed=2, iterations=40, documents=docs,
                         noise=Noise(os_noise_prob=0.0), heartbeats=False)
    truth = GroundTruth(cfg)
    f = np.array([_first_op(truth, i) for i in range(40)])
    cv = f.std() / f.mean()
    assert 0.003 < cv < 0.03


def test_compute_and_link_faults_scale_the_right_timings() -> None:
    plan = Plan.uniform(8, 2, 2, 32, 4)  # every stage on its own node: P2P crosses nodes
    faults = (Fault("compute", 3, 2, 2.0), Fault("link", 12, 2, 3.0))
    cfg = WorkloadConfig(MODEL, plan, budget=8192, seed=2, iterations=4, noise=Noise.quiet(), faults=faults,
                         heartbeats=False)
    truth = GroundTruth(cfg)
    before, after = truth.timings(0, 0.0), truth.timings(2, 0.0)
    ix = truth.index
    busy = lambda t, r: float(np.nansum(t.compute[ix.pos[r]]))  # noqa: E731
    assert busy(after, 3) / busy(before, 3) > 1.6
    assert busy(after, 2) / busy(before, 2) < 1.3
    p2p = lambda t, r: float(np.nanmedian(t.p2p[ix.pos[r]]))  # noqa: E731
    assert p2p(after, 12) / p2p(before, 12) > 2.0  # rank 12 (replica 1, stage 1) receives over its slow NIC
    assert after.dp is not None and before.dp is not None
    assert after.dp[ix.pos[12]] / before.dp[ix.pos[12]] > 2.0  # and its DP ring slows


def test_fail_stop_with_and_without_exit_event() -> None:
    plan = Plan.uniform(2, 2, 1, 32, 2)
    loud = WorkloadConfig(MODEL, plan, budget=8192, iterations=10, faults=(Fault("stop", 1, 5),))
    recs = records_list(loud)
    assert [r for r in recs if isinstance(r, ExitEvent)][0].rank == 1
    assert max(r.iteration for r in recs if isinstance(r, IterationRecord)) == 4
    silent = WorkloadConfig(MODEL, plan, budget=8192, iterations=10, faults=(Fault("stop", 1, 5, exit_event=False),))
    recs = records_list(silent)
    assert not any(isinstance(r, ExitEvent) for r in recs)
    last_beat = {r.rank: r.time_s for r in recs if isinstance(r, HeartbeatEvent)}
    assert last_beat[0] - last_beat[1] > silent.heartbeat_timeout_s


def test_trace_round_trips_through_the_trace_reader() -> None:
    plan = Plan.uniform(2, 2, 2, 32, 4, Schedule.ZB_H1)
    cfg = WorkloadConfig(MODEL, plan, budget=16384, seed=9, iterations=3)
    buf = io.StringIO()
    write_trace(buf, make_header(cfg), records_list(cfg))
    header, recs = read_trace(io.StringIO(buf.getvalue()))
    records = list(recs)
    its = [r for r in records if isinstance(r, IterationRecord)]
    assert header.plan == plan and len(its) == 3
    assert {c.kind for c in its[0].chunks} == {"F", "B", "W", "P2P", "DP", "OPT"}
    assert header.tokens_per_microbatch == 16384


def test_config_rejects_unknown_ranks_and_bad_factors() -> None:
    plan = Plan.uniform(1, 2, 1, 32, 2)
    with pytest.raises(ValueError, match="rank 9 is not in the plan"):
        WorkloadConfig(MODEL, plan, faults=(Fault("compute", 9, 1, 2.0),))
    with pytest.raises(ValueError, match="factor must be >= 1"):
        WorkloadConfig(MODEL, plan, faults=(Fault("compute", 1, 1, 0.5),))
