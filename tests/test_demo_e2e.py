"""The main job for real: ``resihp demo`` — 8 ranks (TP2 x PP2 x DP2) under ``resihp launch``
(coordinator + agent processes, mpirun with ULFM), a real 2x throttle of rank 2's compute,
then a SIGKILL of rank 5 (or of a rank holding state, if the re-plan left 5 idle). The job must detect both, reconfigure live, finish every step
exactly once, and train the same loss curve as an uninterrupted single-process run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from demo_run import jsonl, run_demo
from fresh_rerun import fresh_on_rerun

from resihp.coordinator.model.plan import Plan

pytestmark = pytest.mark.flaky(reruns=2)  # 8 ranks + daemons on 2 cores; ULFM can crash a rank in MPI_Init

STEPS, SLOW_AT, KILL_AT = 36, 8, 20  # 16 steps after the kill: after the re-plan a step takes ~0.1 s
# 3x, not the demo's 2x: a sleeping throttle hands its core to the other ranks, and on a
# loaded 2-core machine a 2x throttle stretched rank 2's chunks only 1.3-1.5x against its
# calibration. The demo's peer-relative policy reads that as 1.6-1.9x (docs/detector.md),
# but this test is about the path (detect, re-plan, switch live, survive the kill, same
# loss), not sensitivity; bench/detect.py measures how small a slowdown is found.
SLOW_FACTOR = 3


def _run_demo(out: Path) -> Path:
    return run_demo(out, "--steps", str(STEPS), "--slow-at", str(SLOW_AT), "--slow-factor", str(SLOW_FACTOR),
                    "--kill-at", str(KILL_AT))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def run(first_run: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's demo run; a rerun of a test judges a fresh one (timings on 2 shared cores)."""
    return fresh_on_rerun(request, first_run, lambda: _run_demo(tmp_path_factory.mktemp("demo")))


def _progress(run: Path) -> list[dict[str, Any]]:
    return jsonl(run / "progress.jsonl")


def _events(run: Path) -> list[dict[str, Any]]:
    return jsonl(run / "events.jsonl")


def test_every_step_is_trained_and_the_loss_matches_the_reference(run: Path) -> None:
    from resihp.report.cli import summarize

    lines = _progress(run)
    steps = [x["step"] for x in lines if x["type"] == "step"]
    # a step may be re-run after the rollback, but every step 0..N-1 is there and the last wins
    assert sorted(set(steps)) == list(range(STEPS))
    s = summarize(run)
    assert s.reference_steps_compared == STEPS
    assert s.loss_delta_vs_reference is not None and s.loss_delta_vs_reference <= 1e-4, s.loss_delta_vs_reference


def test_the_slow_rank_is_detected_and_the_job_reconfigures_around_it(run: Path) -> None:
    from resihp.report.cli import summarize

    s = summarize(run)
    slow = next(d for d in s.detections if d.kind == "slow")
    # the finding names rank 2 alone: its TP partner 3 waits for it inside the all-reduces,
    # so its spans are as long, and the TP chunks (time inside collectives) tell them apart
    assert slow.rank == 2 and slow.latency_s is not None and slow.finding_ranks == (2,), slow
    planned = [r for r in s.reconfigs if r.kind == "planned"]
    assert planned, "no planned reconfiguration after the fail-slow"


def test_the_killed_rank_is_survived_with_the_coordinators_plan(run: Path) -> None:
    from resihp.report.cli import summarize

    s = summarize(run)
    stop = next(d for d in s.detections if d.kind == "kill")
    killed = stop.rank
    assert stop.finding_kind == "fail-stop" and stop.latency_s is not None
    failstop = [r for r in s.reconfigs if r.kind == "fail-stop"]
    assert len(failstop) == 1 and f"lost ranks [{killed}]" in failstop[0].reason
    # the demo kills rank 5, or, when the re-plan after the fail-slow left rank 5 idle (the
    # planner's answer varies between near-equal layouts), a rank that holds state
    killed_at = max(e["time"] for e in _events(run) if e["event"] == "inject-result" and e.get("kind") == "kill")
    commands = [e for e in _events(run) if e["event"] == "command" and e["kind"] == "reconfigure"]
    in_force = [c for c in commands if c["time"] < killed_at]
    members = set(Plan.from_dict(in_force[-1]["plan"]).ranks()) if in_force else set(range(8))
    assert killed in members and (killed == 5 or 5 not in members), (killed, sorted(members))
    # resumed from the survivors' last common step, not from a checkpoint. The logged step
    # comes from a last-stage rank, which may be one step ahead of the dead rank's TP
    # partner (StepGuard): then that step is re-run, so the resume step is `done` itself.
    # Not KILL_AT + small: the kill lands when the demo's driver has seen step KILL_AT and
    # called `resihp admin inject`, steps later when the re-plan made steps fast
    done = max(x["step"] for x in _progress(run) if x["type"] == "step" and x["time"] < killed_at)
    assert done <= failstop[0].step <= done + 2, (done, failstop[0].step)
    acked = [e for e in _events(run) if e["event"] == "state" and e.get("trigger") == "acked"]
    assert acked, "the coordinator never saw its plan acknowledged"
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_control_plane_handled_every_report_and_ack(run: Path) -> None:
    """The coordinator catches a failing handler so one bad item cannot end an agent's
    stream; in the main job nothing may take that path (after the fail-stop a record of
    the recovered plan used to reach a detector still on the old plan: an IndexError)."""
    log = (run / "coordinator.log").read_text()
    assert "handling a" not in log and "Traceback" not in log, log[-3000:]
