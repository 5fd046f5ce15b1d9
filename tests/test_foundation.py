"""The shared value types: model spec, plan, trace format."""
from __future__ import annotations

import io
import subprocess

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset
from resihp.coordinator.model.trace import (
    ChunkTiming,
    DeviceInfo,
    ExitEvent,
    IterationRecord,
    TraceError,
    TraceHeader,
    read_trace,
    write_trace,
)


def test_uniform_plan_layout_is_tp_fastest_then_pp_then_dp() -> None:
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, global_microbatches=6)
    assert plan.replicas[1].stages == ((4, 5), (6, 7))
    assert plan.position(6).replica == 1 and plan.position(6).stage == 1 and plan.position(6).tp_index == 0
    assert [r.microbatches for r in plan.replicas] == [3, 3]
    assert plan.replicas[0].layer_ranges() == ((0, 4), (4, 8))
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_rejects_duplicate_ranks_and_bad_tp() -> None:
    with pytest.raises(SpecError, match="rank 1 appears twice"):
        Plan.from_dict({"replicas": [{"stages": [[0, 1], [1, 2]], "layers": [2, 2], "microbatches": 1}]})
    plan = Plan.from_dict({"replicas": [{"stages": [[0, 1, 2]], "layers": [4], "microbatches": 1}]})
    with pytest.raises(SpecError, match="powers of two"):
        plan.validate_for(num_layers=4, num_heads=4)


def test_model_spec_validation_messages() -> None:
    with pytest.raises(SpecError, match="divisible by num_heads"):
        ModelSpec("bad", 2, 100, 3, 10, 10)
    with pytest.raises(SpecError, match="unknown model preset"):
        preset("gpt-9000")
    assert preset("llama2-13b").num_heads == 40


def _trace_text() -> str:
    header = TraceHeader(
        preset("gpt-tiny"), Plan.uniform(2, 2, 2, 8, 4), tuple(DeviceInfo(r, f"n{r // 4}") for r in range(8))
    )
    recs = [
        IterationRecord(0, 0.0, 1.0, (((100, 20), (50,)), ((10,), (3, 4))), (ChunkTiming(0, "F", 0, 0, 0.0, 0.1),)),
        ExitEvent(3, 2.0, -9),
    ]
    buf = io.StringIO()
    write_trace(buf, header, recs)
    return buf.getvalue()


def test_trace_round_trip() -> None:
    header, recs = read_trace(io.StringIO(_trace_text()))
    records = list(recs)
    assert header.plan.dp == 2 and header.node_of(5) == "n1"
    assert isinstance(records[0], IterationRecord) and records[0].chunks[0].duration_s == pytest.approx(0.1)
    assert records[1] == ExitEvent(3, 2.0, -9)


@pytest.mark.parametrize(
    "old,new,line,field",
    [
        ('"time_s":1.0', '"time_s":NaN', 2, "time_s"),
        ('"time_s":1.0', '"time_s":-1', 2, "time_s"),
        ('"exit","rank":3', '"exit","rank":99', 3, "rank"),
        ('"format":1', '"format":7', 1, "format"),
        ('[[100,20],[50]]', '[[100,20]]', 2, "seqlens[0]"),
    ],
)
def test_trace_errors_name_line_and_field(old: str, new: str, line: int, field: str) -> None:
    text = _trace_text()
    assert old in text
    with pytest.raises(TraceError) as info:
        header, recs = read_trace(io.StringIO(text.replace(old, new, 1)))
        list(recs)
    assert info.value.line == line and info.value.field == field


def test_console_script_lists_commands(resihp_exe: str) -> None:
    out = subprocess.run([resihp_exe, "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("detect", "plan", "launch", "admin", "simulate"):
        assert f"  {name}" in out
    bad = subprocess.run([resihp_exe, "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
