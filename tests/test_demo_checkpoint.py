"""Fail-stop with no replica to copy from (TP2 x PP2 x DP1, 4 ranks under ``resihp launch``):
the survivors fall back on the latest asynchronous checkpoint, say so in the progress log,
re-train the steps since, and end on the uninterrupted run's loss curve."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.flaky(reruns=2)  # real ranks + daemons on 2 cores; ULFM can crash a rank in MPI_Init

STEPS, KILL_AT, EVERY = 18, 10, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp1")
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "demo", "--tp", "2", "--pp", "2", "--dp", "1", "--no-slow",
         "--kill-rank", "3", "--kill-at", str(KILL_AT), "--checkpoint-every", str(EVERY), "--steps", str(STEPS),
         "--quiet", "--run-dir", str(out), "--timeout-s", "500"],
        capture_output=True, text=True, timeout=800,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{(out / 'launch.log').read_text()[-3000:]}"
    return out


def test_the_survivors_restore_the_latest_checkpoint_and_say_so(run: Path) -> None:
    lines = [json.loads(x) for x in (run / "progress.jsonl").read_text().splitlines() if x.strip()]
    rec = [x for x in lines if x["type"] == "reconfig"]
    assert len(rec) == 1 and rec[0]["kind"] == "fail-stop-checkpoint", rec
    assert "restored from the checkpoint of step" in rec[0]["reason"] and "lost ranks [3]" in rec[0]["reason"]
    resumed = rec[0]["step"]
    assert resumed % EVERY == 0 and resumed <= KILL_AT + 2  # the step after a checkpoint
    steps = [x["step"] for x in lines if x["type"] == "step"]
    assert sorted(set(steps)) == list(range(STEPS))
    trained_before = max(x["step"] for x in lines if x["type"] == "step" and x["time"] < rec[0]["time"])
    again = [s for s in range(resumed, trained_before + 1)]
    assert all(steps.count(s) == 2 for s in again)  # the steps since the checkpoint ran again, once
    assert ("are trained again" in rec[0]["reason"]) == bool(again)


def test_the_loss_curve_matches_the_uninterrupted_reference(run: Path) -> None:
    from resihp.report import summarize

    s = summarize(run)
    assert s.reference_steps_compared == STEPS
    assert s.loss_delta_vs_reference is not None and s.loss_delta_vs_reference <= 1e-4
