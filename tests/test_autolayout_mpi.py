"""``--layout auto`` for real: the candidates timed on the job's own ranks (mpirun, gloo), the job
started at the choice (coordinator and ranks agree), and training unchanged by the profile."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cp_helpers import read_jsonl

from resihp.coordinator.planner.autolayout import Layout, choose
from resihp.trainer_hooks.launch.launcher import find_mpirun

pytestmark = pytest.mark.flaky(reruns=1)  # real multi-process jobs on 2 shared cores

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train_gpt.py")
STEPS = 4


def _losses(progress: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_jsonl(progress) if r.get("type") == "step"}


def test_launch_layout_auto_times_every_healthy_layout_and_starts_the_job_at_the_fastest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "launch", "-n", "4", "--nodes", "2", "--layout", "auto",
         "--microbatches", "4", "--gpu-sampler", "off", "--run-dir", str(run), "--",
         sys.executable, TRAIN, "--steps", str(STEPS), "--microbatches", "4", "--log-every", "1"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((run / "layout.json").read_text())
    # 4 ranks, 2 per node, 4 heads, 8 layers, 4 micro-batches: five layouts, every one timed
    assert {c["layout"] for c in record["candidates"]} == {
        "TP1xPP1xDP4", "TP1xPP2xDP2", "TP1xPP4xDP1", "TP2xPP1xDP2", "TP2xPP2xDP1"}
    assert all(c["measured_s"] and all(s > 0 for s in c["measured_s"]) for c in record["candidates"])
    timed = {Layout.parse(c["layout"]): sorted(c["measured_s"])[len(c["measured_s"]) // 2] if len(
        c["measured_s"]) % 2 else sum(c["measured_s"]) / 2 for c in record["candidates"] if not c["cut_short"]}
    assert choose(timed).layout.describe() == record["layout"]  # the rule, on the times it recorded
    assert "layout profile: gpt-tiny on 4 ranks" in done.stdout and "<- chosen" in done.stdout
    # the job ran at that layout from its first step; the coordinator was started at it too
    steps = [r for r in read_jsonl(run / "progress.jsonl") if r.get("type") == "step"]
    assert len(steps) == STEPS and {r["plan"].split(" mb ")[0] for r in steps} == {record["layout"]}
    header = json.loads((run / "trace.jsonl").read_text().splitlines()[0])
    lay = Layout.parse(record["layout"])
    assert len(header["plan"]["replicas"]) == lay.dp and len(header["plan"]["replicas"][0]["stages"]) == lay.pp
    assert not [e for e in read_jsonl(run / "events.jsonl") if e.get("event") == "layout-mismatch"]
    # nothing of the profile reaches training: the losses are one process's, step for step
    ref = tmp_path / "ref"
    ref.mkdir()
    single = subprocess.run([sys.executable, TRAIN, "--steps", str(STEPS), "--microbatches", "4", "--log-every", "1",
                             "--no-resilience"], capture_output=True, text=True, timeout=300,
                            cwd=ref, env={**_clean_env(), "RESIHP_PROGRESS": str(ref / "progress.jsonl")})
    assert single.returncode == 0, single.stderr[-2000:]
    got, want = _losses(run / "progress.jsonl"), _losses(ref / "progress.jsonl")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    # the same batches and weights; only the reduction order of the DP/TP sums differs
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in want), (got, want)


def test_init_with_auto_layout_under_plain_mpirun_profiles_in_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable, TRAIN, "--layout", "auto",
         "--steps", "2", "--microbatches", "4", "--log-every", "1", "--no-resilience"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chosen = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("  chosen: "))
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(chosen in line for line in steps), done.stdout


def test_launch_layout_auto_errors_say_what_to_do(tmp_path: Path) -> None:
    both = subprocess.run([sys.executable, "-m", "resihp.cli", "launch", "-n", "2", "--layout", "auto", "--tp", "2",
                           "--run-dir", str(tmp_path / "a"), "--", sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--layout auto chooses TP, PP and DP itself" in both.stderr
    # a script that never reaches init with an automatic layout: said, with where its output is
    plain = subprocess.run([sys.executable, "-m", "resihp.cli", "launch", "-n", "2", "--layout", "auto",
                            "--gpu-sampler", "off", "--run-dir", str(tmp_path / "b"), "--",
                            sys.executable, "-c", "print('hello from a rank')"],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2, plain.stdout + plain.stderr
    assert "printed no choice: the training script must call hooks.init with AutoLayout" in plain.stderr
    assert "hello from a rank" in (tmp_path / "b" / "layout-profile.log").read_text()
    assert not (tmp_path / "b" / "coordinator.json").exists()  # nothing was started


def _clean_env() -> dict[str, str]:
    import os

    # the job's own variables go; the backend stays (bench/gpu_check.sh runs this on NCCL)
    return {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_") or k == "RESIHP_BACKEND"}
