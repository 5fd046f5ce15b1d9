"""Failure processes, failure-trace files and determinism under a seed."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest

from resihp.sim import scenarios
from resihp.sim.failures import (
    LLAMA3_CAUSES,
    LLAMA3_RATE_PER_GPU_HOUR,
    FailureTraceError,
    dump_trace,
    fail_slows,
    fail_stops,
    parse_trace,
)
from resihp.sim.runner import compare
from resihp.sim.world import FailSlow, FailStop


def test_llama3_rate_and_cause_mix() -> None:
    assert LLAMA3_RATE_PER_GPU_HOUR == pytest.approx(1.97e-5, rel=0.01)
    faults = fail_stops(np.random.default_rng(1), 16384, 8, 54 * 24 * 3600.0)
    assert 419 * 0.85 < len(faults) < 419 * 1.15  # Llama 3 saw 419 in 54 days on 16,384 GPUs
    gpu_share = sum(f.cause == "faulty-gpu" for f in faults) / len(faults)
    assert gpu_share == pytest.approx(148 / 419, abs=0.06)
    for f in faults:
        if f.scope == "node":
            assert len(f.ranks) == 8 and f.ranks[0] % 8 == 0
        else:
            assert len(f.ranks) == 1
    assert {c.scope for c in LLAMA3_CAUSES} == {"gpu", "node", "process"}


def test_accelerated_fail_stops_arrive_on_the_clock() -> None:
    faults = fail_stops(np.random.default_rng(0), 256, 8, 3 * 3600.0, every_s=1800.0)
    assert [f.time_s for f in faults] == [1800.0, 3600.0, 5400.0, 7200.0, 9000.0]


def test_fail_slow_kinds_durations_and_magnitudes() -> None:
    faults = fail_slows(np.random.default_rng(3), 512, 8, 4000 * 3600.0)
    comp = [f for f in faults if f.slow_kind == "compute"]
    comm = [f for f in faults if f.slow_kind == "communication"]
    assert len(comm) > len(comp) > 0  # Greyhound: communication fail-slows dominate
    assert np.mean([f.duration_s for f in comp]) == pytest.approx(600.0, rel=0.2)
    assert np.mean([f.duration_s for f in comm]) == pytest.approx(1440.0, rel=0.2)
    assert all(1.1 <= f.factor <= 3.0 for f in comp) and all(1.2 <= f.factor <= 6.0 for f in comm)
    assert all(len(f.ranks) == 8 for f in comm) and all(len(f.ranks) == 1 for f in comp)


def test_scenarios_are_deterministic_under_a_seed() -> None:
    sc = scenarios.get("paper-mixed")
    job = scenarios.job_for("llama2-70b", 256)
    assert sc.make(job, 6.0, 7) == sc.make(job, 6.0, 7)
    assert sc.make(job, 6.0, 7) != sc.make(job, 6.0, 8)


def test_whole_comparison_is_deterministic() -> None:
    sc = scenarios.get("paper-failstop")
    job = scenarios.job_for("llama2-70b", 256)
    names = ["ckpt-restart", "oobleck", "recycle"]
    a = compare(sc, job, 2.0, 5, names)
    b = compare(sc, job, 2.0, 5, names)
    assert [(r.policy, r.tokens, r.segments) for r in a.results] == [(r.policy, r.tokens, r.segments) for r in b.results]


HEADER = '{"format": 1, "type": "header", "gpus": 16, "gpus_per_node": 8}\n'


def test_trace_round_trip() -> None:
    faults = [FailStop(10.0, (3,), "faulty-gpu", "gpu", 3600.0), FailStop(20.0, tuple(range(8, 16)), "nic", "node"),
              FailSlow(30.0, (5,), 2.5, 600.0, "compute", "gpu-throttling")]
    buf = io.StringIO()
    dump_trace(faults, buf, 16, 8)
    back = parse_trace(io.StringIO(buf.getvalue()), 16, 8)
    assert back == faults
    node = parse_trace(io.StringIO(HEADER + '{"type": "fail-stop", "time_s": 5, "node": 1}\n'), 16, 8)
    assert isinstance(node[0], FailStop)
    assert node[0].ranks == tuple(range(8, 16)) and node[0].scope == "node" and math.isinf(node[0].repair_s)


@pytest.mark.parametrize(
    "text,line,field",
    [
        ("", 1, "header"),
        ('{"type": "fail-stop"}\n', 1, "type"),
        ('{"format": 2, "type": "header"}\n', 1, "format"),
        ('{"format": 1, "type": "header", "gpus": 64}\n', 1, "gpus"),
        (HEADER + "{not json}\n", 2, "json"),
        (HEADER + '{"type": "fail-stop", "ranks": [1]}\n', 2, "time_s"),
        (HEADER + '{"type": "fail-stop", "time_s": -1, "ranks": [1]}\n', 2, "time_s"),
        (HEADER + '{"type": "fail-stop", "time_s": 1, "ranks": [99]}\n', 2, "ranks"),
        (HEADER + '{"type": "fail-stop", "time_s": 1, "ranks": [1], "node": 0}\n', 2, "ranks"),
        (HEADER + '{"type": "fail-stop", "time_s": 1, "node": 5}\n', 2, "node"),
        (HEADER + '{"type": "fail-stop", "time_s": 1, "ranks": [1], "scope": "rack"}\n', 2, "scope"),
        (HEADER + '\n{"type": "fail-slow", "time_s": 1, "ranks": [1], "kind": "compute", "factor": 0.5, "duration_s": 9}\n',
         3, "factor"),
        (HEADER + '{"type": "fail-slow", "time_s": 1, "ranks": [1], "kind": "disk", "factor": 2, "duration_s": 9}\n',
         2, "kind"),
        (HEADER + '{"type": "fail-slow", "time_s": 1, "ranks": [1], "kind": "compute", "factor": 2}\n', 2, "duration_s"),
        (HEADER + '{"type": "meteor", "time_s": 1, "ranks": [1]}\n', 2, "type"),
    ],
)
def test_trace_errors_name_line_and_field(text: str, line: int, field: str) -> None:
    with pytest.raises(FailureTraceError) as info:
        parse_trace(io.StringIO(text), 16, 8)
    assert (info.value.line, info.value.field) == (line, field)
    assert f"line {line}" in str(info.value)


def test_job_layouts_tuned_and_paper() -> None:
    tuned = scenarios.job_for("llama2-70b", 256)
    paper = scenarios.job_for("llama2-70b", 256, layout="paper")
    assert (paper.tp, paper.pp, paper.dp) == (4, 16, 4)
    assert tuned.world_size == paper.world_size == 256 and (tuned.tp * tuned.pp) % 8 == 0
    from resihp.sim.perf import PerfModel
    from resihp.sim.world import World

    def rate(job: scenarios.JobSpec) -> float:
        return PerfModel(job).tokens_per_s(job.initial_plan(), World(job.world_size, job.gpus_per_node))

    assert rate(tuned) >= rate(paper)
    with pytest.raises(scenarios.SpecError, match="unknown layout"):
        scenarios.job_for("llama2-70b", 256, layout="fancy")
