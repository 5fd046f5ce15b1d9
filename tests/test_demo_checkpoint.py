"""Fail-stop with no replica to copy from (TP2 x PP2 x DP1, 4 ranks under ``resihp launch``):
the survivors fall back on the latest asynchronous checkpoint, say so in the progress log,
re-train the steps since, and end on the uninterrupted run's loss curve."""
from __future__ import annotations

from pathlib import Path

import pytest
from demo_run import jsonl, run_demo
from fresh_rerun import run_fixtures

pytestmark = pytest.mark.flaky(reruns=2)  # real ranks + daemons on 2 cores; ULFM can crash a rank in MPI_Init

STEPS, KILL_AT, EVERY = 18, 10, 4


def _run_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_demo(tmp_path_factory.mktemp("dp1"), "--tp", "2", "--pp", "2", "--dp", "1", "--no-slow",
                    "--kill-rank", "3", "--kill-at", str(KILL_AT), "--checkpoint-every", str(EVERY),
                    "--steps", str(STEPS), timeout_s=500)


first_run, run = run_fixtures(_run_demo, "run")  # a rerun judges a fresh run


def test_the_survivors_restore_the_latest_checkpoint_and_say_so(run: Path) -> None:
    lines = jsonl(run / "progress.jsonl")
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
    from resihp.report.cli import summarize

    s = summarize(run)
    assert s.reference_steps_compared == STEPS
    assert s.loss_delta_vs_reference is not None and s.loss_delta_vs_reference <= 1e-4
