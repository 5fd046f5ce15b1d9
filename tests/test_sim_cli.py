"""`resihp simulate` end to end: table, plot, trace replay, clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from resihp.sim.cli import main

TRACE = """{"format": 1, "type": "header", "gpus": 16, "gpus_per_node": 8, "description": "two faults"}
{"type": "fail-stop", "time_s": 1200, "ranks": [3], "cause": "faulty-gpu", "scope": "gpu", "repair_s": 1800}
{"type": "fail-slow", "time_s": 2400, "ranks": [9], "kind": "compute", "factor": 2.0, "duration_s": 900}
"""


def test_simulate_replays_a_trace_and_draws_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "faults.jsonl"
    trace.write_text(TRACE)
    png = tmp_path / "tp.png"
    saved = tmp_path / "saved.jsonl"
    rc = main(["--scenario", str(trace), "--gpus", "16", "--model", "llama2-7b", "--hours", "1.5",
               "--policies", "static,ckpt-restart,oobleck,resihp", "--plot", str(png), "--save-trace", str(saved)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1 fail-stops, 1 fail-slows" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if len(line.split()) == 8 and
            line.split()[0] in ("static", "ckpt-restart", "oobleck", "resihp")}
    assert set(rows) == {"static", "ckpt-restart", "oobleck", "resihp"}
    goodput = {name: float(cols[2]) for name, cols in rows.items()}
    assert goodput["resihp"] > goodput["static"]
    # where resihp's tokens went: the parts add up to its shortfall against the upper bound
    below = next(line for line in out.splitlines() if line.startswith("resihp below the upper bound by "))
    total = float(below.split(" by ")[1].split(" %")[0])
    parts = [float(p.split()[-2]) for p in below.split(": ", 1)[1].split(", ")]
    assert total == pytest.approx(100 * (1 - float(rows["resihp"][3])), abs=0.06)
    assert sum(parts) == pytest.approx(total, abs=0.05 * len(parts)) and "re-plan pauses" in below
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved.read_text().count("\n") == 3


def test_bad_trace_exits_2_naming_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(TRACE.replace('"factor": 2.0', '"factor": "fast"'))
    assert main(["--scenario", str(trace), "--gpus", "16", "--model", "llama2-7b", "--hours", "1"]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "'factor'" in err


def test_unknown_scenario_and_model_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "armageddon", "--gpus", "16"]) == 2
    assert "unknown scenario 'armageddon'" in capsys.readouterr().err
    assert main(["--scenario", "paper-failstop", "--gpus", "16", "--model", "gpt-9000"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["--scenario", "paper-failstop", "--gpus", "12", "--model", "llama2-70b"]) == 2
    assert "no uniform layout" in capsys.readouterr().err


def test_simulate_takes_the_layout_and_documents_and_refuses_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--scenario", "paper-failstop", "--gpus", "64", "--model", "llama2-7b", "--hours", "0.5",
               "--layout", "paper", "--documents", "4", "--policies", "static,resihp"])
    out = capsys.readouterr().out
    assert rc == 0 and "llama2-7b on 64 GPUs" in out and "resihp" in out
    assert main(["--scenario", "paper-failstop", "--gpus", "64", "--model", "llama2-7b", "--documents", "0"]) == 2
    assert "documents must be in 1..8192, got 0" in capsys.readouterr().err
