"""`resihp plan` end to end through the installed console script."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

EX = Path(__file__).resolve().parents[1] / "examples" / "plan"


def run(exe: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "plan", *args], capture_output=True, text=True, timeout=120)


def small(*extra: str) -> list[str]:
    return [
        "--cluster", str(EX / "cluster-2x4-slow.json"), "--model", str(EX / "model-llama2-7b.json"),
        "--current", str(EX / "current-tp2-pp2-dp2.json"), *extra,
    ]


def test_fail_slow_prints_summary_and_plan(resihp_exe: str) -> None:
    proc = run(resihp_exe, *small("--finding", str(EX / "finding-slow-rank2.json")))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("decision: RE-PLAN")
    assert "why: fail-slow of ranks [2]" in out and "predicted iteration:" in out and "shape: TP2 PP2 DP2" in out
    decision = json.loads(out[out.index("\n{") + 1:])
    assert decision["act"] is True
    assert decision["predicted_iteration_s_after"] < decision["predicted_iteration_s_before"]
    assert sum(rep["microbatches"] for rep in decision["plan"]["replicas"]) == 16
    assert decision["simulated_iteration_s"] > 0


def test_fail_stop_plan_excludes_the_lost_rank(resihp_exe: str, tmp_path: Path) -> None:
    finding = tmp_path / "stop.json"
    finding.write_text(json.dumps({"kind": "fail-stop", "ranks": [5], "factor": 1.0, "cause": "process-exit"}))
    out_plan = tmp_path / "plan.json"
    proc = run(resihp_exe, *small("--finding", str(finding), "--json", "--out", str(out_plan)))
    assert proc.returncode == 0, proc.stderr
    decision = json.loads(proc.stdout)
    assert decision["act"] is True and decision["predicted_iteration_s_before"] is None
    ranks = {r for rep in decision["plan"]["replicas"] for g in rep["stages"] for r in g}
    assert 5 not in ranks and 5 not in decision["plan"]["spares"]
    assert json.loads(out_plan.read_text()) == decision["plan"]


def test_same_input_same_output(resihp_exe: str) -> None:
    a = run(resihp_exe, *small("--finding", str(EX / "finding-slow-rank2.json"), "--json"))
    b = run(resihp_exe, *small("--finding", str(EX / "finding-slow-rank2.json"), "--json"))
    assert a.returncode == 0 and a.stdout == b.stdout


def write(tmp_path: Path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("malformed", "is not valid JSON: Expecting property name"),
        ("missing", "does not exist"),
        ("all-failed", "no healthy device"),
        ("cannot-fit", "does not fit in memory"),
        ("contradictory-shape", "layer counts; expected pp × virtual_chunks"),
        ("ranks-outside", "not in the cluster"),
        ("batch-mismatch", "contradictory input"),
        ("bad-finding", "field 'kind' must be one of"),
        ("bad-model", "unknown model preset"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(resihp_exe: str, tmp_path: Path, case: str, message: str) -> None:
    cluster = str(EX / "cluster-2x4-slow.json")
    model = str(EX / "model-llama2-7b.json")
    current = str(EX / "current-tp2-pp2-dp2.json")
    extra: list[str] = []
    if case == "malformed":
        cluster = write(tmp_path, "c.json", "{bad json")
    elif case == "missing":
        cluster = str(tmp_path / "nope.json")
    elif case == "all-failed":
        cluster = write(tmp_path, "c.json", {"nodes": 2, "devices_per_node": 4, "failed": list(range(8))})
    elif case == "cannot-fit":
        cluster = write(tmp_path, "c.json", {"nodes": 2, "devices_per_node": 4, "memory_bytes": 4 * 2**30})
    elif case == "contradictory-shape":
        # two chunks per device declared, one layer count per device given
        current = write(tmp_path, "p.json", {"replicas": [{"stages": [[0, 1], [2, 3]], "layers": [16, 16],
                                                           "microbatches": 16}],
                                             "schedule": "interleaved-1f1b", "virtual_chunks": 2})
    elif case == "ranks-outside":
        current = write(tmp_path, "p.json", {"tp": 4, "pp": 2, "dp": 2, "num_layers": 32, "global_microbatches": 16})
    elif case == "batch-mismatch":
        extra = ["--batch", write(tmp_path, "b.json", {"microbatches": 12, "tokens_per_microbatch": 4096})]
    elif case == "bad-finding":
        extra = ["--finding", write(tmp_path, "f.json", {"kind": "exploded", "ranks": [1]})]
    elif case == "bad-model":
        model = write(tmp_path, "m.json", {"preset": "gpt-17"})
    proc = run(resihp_exe, "--cluster", cluster, "--model", model, "--current", current, *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("resihp plan: error:")
    assert message in proc.stderr
