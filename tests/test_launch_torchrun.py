"""``resihp launch`` runs a torchrun-style script unmodified (RANK, WORLD_SIZE, MASTER_ADDR, ...,
its own ``init_process_group`` from env://, which ``init`` reuses), closes it at exit without
a fail-stop, and fails loudly (exit status, one summary block) when a rank fails."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from cp_helpers import read_jsonl

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "mpi_scripts" / "torchrun_style.py")

# real mpirun jobs on a 2-core machine: one fresh retry for an infrastructure crash at start-up
pytestmark = pytest.mark.flaky(reruns=1)


def _launch(run: Path, *script_args: str, launch_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", "launch", "-n", "4", "--gpu-sampler", "off", "--run-dir", str(run),
         "--finalize-grace-s", "2", "--heartbeat-timeout-s", "5", *launch_args, "--", sys.executable, SCRIPT,
         str(run / "ranks.jsonl"), *script_args],
        capture_output=True, text=True, timeout=240)


def _no_orphans(lines: list[dict[str, Any]]) -> None:
    pids = {e["pid"] for e in lines}
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphans left behind: {left}"


def test_a_torchrun_script_runs_as_ddp_reuses_its_group_and_closes_at_exit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _launch(run, "--steps", "3", launch_args=("--model", "gpt-tiny"))
    # the launch's --model differs from the script's module: every rank refuses at init
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "`resihp launch --model` describes 'gpt-tiny'" in done.stderr and "the script trains 'TinyGPT'" in done.stderr
    assert "resihp launch: job FAILED (exit status 1)" in done.stderr

    run = tmp_path / "run2"
    done = _launch(run, "--steps", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = read_jsonl(run / "ranks.jsonl")
    envs = sorted((e for e in lines if e["event"] == "env"), key=lambda e: int(e["env"]["RANK"]))
    assert [e["env"]["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["env"]["WORLD_SIZE"] for e in envs} == {"4"} and {e["env"]["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert sorted(e["env"]["LOCAL_RANK"] for e in envs) == ["0", "1", "2", "3"]  # unique on the node
    assert {e["env"]["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    (port,) = {e["env"]["MASTER_PORT"] for e in envs}
    assert port.isdigit() and 0 < int(port) < 65536
    assert [e["all_reduce"] for e in envs] == [10.0] * 4 and [e["dist_rank"] for e in envs] == [0, 1, 2, 3]
    restart = envs[0]["env"]["RESIHP_RESTART_CMD"]
    assert "launch -n 4" in restart and restart.endswith(f"{SCRIPT} {run / 'ranks.jsonl'} --steps 3")
    inits = sorted((e for e in lines if e["event"] == "init"), key=lambda e: e["rank"])
    assert [(e["rank"], e["world"], e["reused"], e["adopted"]) for e in inits] == [(r, 4, True, True) for r in range(4)]
    assert inits[0]["spec"]["num_layers"] == 2 and inits[0]["spec"]["hidden"] == 32  # read from module.config
    trained = [e for e in lines if e["event"] == "trained"]
    assert {e["global_microbatches"] for e in trained} == {16}  # 4 per rank, learned from the first step
    events = read_jsonl(run / "events.jsonl")
    assert not [e for e in events if e["event"] == "finding"], "a rank that never called close was a fail-stop"
    assert sum(e["event"] == "rank-finished" for e in events) == 4 and any(e["event"] == "job-finished" for e in events)
    steps = [e for e in read_jsonl(run / "progress.jsonl") if e["type"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2] and {s["tokens"] for s in steps} == {4 * 16 * 4}
    report = subprocess.run([sys.executable, "-m", "resihp.cli", "report", str(run), "--no-png"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "3 steps (0-2)" in report.stdout, report.stdout + report.stderr
    _no_orphans(lines)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_launch_fails_with_a_summary_when_a_rank_fails(tmp_path: Path, how: str) -> None:
    run = tmp_path / "run"
    done = _launch(run, "--steps", "5", "--fail-rank" if how == "exit" else "--kill-rank", "1")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    block = done.stderr[done.stderr.index("resihp launch: job FAILED"):].splitlines()
    assert block[0] == "resihp launch: job FAILED (exit status 1)"
    assert block[1].startswith("  rank 1: "), block  # the first to fail leads
    assert "restart from the last checkpoint with:" in block[-2] and "launch -n 4" in block[-1]
    lines = read_jsonl(run / "ranks.jsonl")
    assert [e["rank"] for e in lines if e["event"] in ("failing", "killing")] == [1]
    _no_orphans(lines)
