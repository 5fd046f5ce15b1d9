"""``resihp detect`` end to end, through the installed console script."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.sim.workload import Fault, Noise, WorkloadConfig, write_workload

SLOW_AT = 24  # after the adaptive detector's warm-up and first healthy samples (16 iterations)


def _trace(tmp_path: Path) -> Path:
    cfg = WorkloadConfig(preset("llama2-7b"), Plan.uniform(2, 2, 2, 32, 8), budget=8192, seed=4, iterations=36,
                         noise=Noise.quiet(), faults=(Fault("compute", 6, SLOW_AT, 2.0), Fault("stop", 1, 34)))
    path = tmp_path / "trace.jsonl"
    write_workload(cfg, str(path))
    return path


def test_detect_writes_findings_as_json_lines(tmp_path: Path, resihp_exe: str) -> None:
    trace = _trace(tmp_path)
    out = tmp_path / "findings.jsonl"
    proc = subprocess.run([resihp_exe, "detect", "--trace", str(trace), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "findings" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["kind"], r["ranks"], r["cause"]) for r in rows] == [
        ("fail-slow", [6], "compute"), ("fail-stop", [1], "process-exit"),
    ]
    slow = rows[0]
    assert (slow["stage"], slow["replica"]) == (1, 1)
    assert SLOW_AT <= slow["iteration"] <= SLOW_AT + 2, slow  # a 2x slowdown: three iterations at most
    assert 1.9 < slow["factor"] < 2.1 and "rank 6" in slow["reason"]
    for key in ("iteration", "kind", "ranks", "stage", "replica", "factor", "reason"):
        assert key in rows[1]


def test_detect_to_stdout_with_config(tmp_path: Path, resihp_exe: str) -> None:
    trace = _trace(tmp_path)
    first = {}
    for confirm in (2, 3):  # fixed thresholds: found after confirm_iters consecutive slow iterations
        config = json.dumps({"adaptive": False, "confirm_iters": confirm})
        proc = subprocess.run([resihp_exe, "detect", "--trace", str(trace), "--config", config],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        first[confirm] = [json.loads(line) for line in proc.stdout.splitlines()][0]["iteration"]
    assert first == {2: SLOW_AT + 1, 3: SLOW_AT + 2}


def test_malformed_trace_names_line_and_field(tmp_path: Path, resihp_exe: str) -> None:
    lines = _trace(tmp_path).read_text().splitlines()
    lines[3] = lines[3].replace('"time_s":', '"time_s":-', 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([resihp_exe, "detect", "--trace", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "line 4" in proc.stderr and "'time_s'" in proc.stderr


def test_missing_trace_and_bad_config_exit_2(tmp_path: Path, resihp_exe: str) -> None:
    proc = subprocess.run([resihp_exe, "detect", "--trace", str(tmp_path / "nope.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read trace" in proc.stderr
    trace = _trace(tmp_path)
    proc = subprocess.run([resihp_exe, "detect", "--trace", str(trace), "--config", '{"slow_threshold": 0}'],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "slow_threshold" in proc.stderr
