"""bench/outsider_traces.py, the independent check of the detector: its traces are valid
format 1 as an outside runtime writes them, and its scoring reads the detector's findings
right (a healthy quiet run: nothing; a 3x compute fault and a 3x path inside a node: found on
their ranks)."""
from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import outsider_traces as outsider  # noqa: E402

from resihp.coordinator.model.trace import IterationRecord, read_trace  # noqa: E402

ITERATIONS = outsider.FAULT_AT + 12


def _job(fault: outsider.Fault, layout: int = 0) -> outsider.Job:
    tp, pp, dp, mbs, per_node = outsider.LAYOUTS[layout]
    return outsider.Job(tp, pp, dp, mbs, per_node, 8192, outsider.NOISE["quiet"], fault, random.Random(3))


def test_a_written_trace_is_format_1_with_dp_spans_from_each_ranks_own_entry() -> None:
    lines = list(outsider.write_trace(_job(outsider.Fault("healthy")), 3))
    header, records = read_trace(io.StringIO("\n".join(lines)))
    assert header.plan.ranks() == tuple(range(16)) and len(header.devices) == 16
    its = [r for r in records if isinstance(r, IterationRecord)]
    assert [r.iteration for r in its] == [0, 1, 2]
    chunks = json.loads(lines[1])["chunks"]
    dp = {c[0]: (c[4], c[5]) for c in chunks if c[1] == "DP"}
    last_b = {}
    for c in chunks:
        if c[1] == "B":
            last_b[c[0]] = max(last_b.get(c[0], 0.0), c[5])
    # a blocking all-reduce: the span starts at the rank's own last backward, ends with its ring
    assert all(dp[r][0] == round(last_b[r], 6) for r in dp)
    assert len({dp[r][1] for r in (0, 8)}) == 1  # ranks 0 and 8 share a ring: one end


def test_the_detector_finds_a_compute_fault_and_a_path_inside_a_node_and_nothing_when_healthy() -> None:
    healthy = outsider.replay(list(outsider.write_trace(_job(outsider.Fault("healthy")), ITERATIONS)))
    assert [f for f in healthy if f.kind == "fail-slow"] == []
    slow = outsider.replay(list(outsider.write_trace(_job(outsider.Fault("compute", 3.0, 5)), ITERATIONS)))
    first = next(f for f in slow if f.kind == "fail-slow")
    assert first.ranks == frozenset({5}) and first.cause == "compute" and first.iteration <= outsider.FAULT_AT + 2
    # ranks 0 -> 2: stages 0 and 1 of replica 0 share node n0 (four GPUs per node)
    job = _job(outsider.Fault("link", 3.0, 0))
    assert job.node(0) == job.node(2)
    path = outsider.replay(list(outsider.write_trace(job, ITERATIONS)))
    got = [f for f in path if f.kind in ("fail-slow", "degraded")]
    assert got and all(f.ranks <= outsider.expected(job)[0] and f.cause == "communication" for f in got), got


def test_a_device_slow_from_the_first_iteration_is_found_in_an_outsider_trace() -> None:
    """A 1.3x device from iteration 0 (never before: its own first iterations were its
    baseline); TP2 x PP4 x DP2: a stage's four ranks are each other's reference."""
    job = _job(outsider.Fault("compute", 1.3, 6, start=0))
    found = [f for f in outsider.replay(list(outsider.write_trace(job, 60))) if f.kind in ("fail-slow", "degraded")]
    assert found and found[0].ranks == frozenset({6}) and found[0].cause == "compute", found
    assert found[0].iteration <= 30 and all(f.ranks == frozenset({6}) for f in found), found
