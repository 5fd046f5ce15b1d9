"""An operator takes a rank out and brings it back, through the real control plane.

``resihp demo`` (8 ranks TP2 x PP2 x DP2 under ``resihp launch``: coordinator, agent, store,
mpirun with ULFM) with no fault injected; ``resihp admin exclude --rank 3`` at step 6 and
``resihp admin readmit --rank 3`` at step 16. The coordinator's planner makes each plan, the
ranks switch live (rank 3 idles as a spare in between, holding nothing), every step is
trained once, and the loss follows the uninterrupted single-process reference. Automatic
re-planning is off (``--no-adapt``): only the operator's calls change the plan, whatever
the detector makes of CPU timings on two shared cores.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from demo_run import jsonl, run_demo
from fresh_rerun import run_fixtures

from resihp.coordinator.model.plan import Plan

pytestmark = pytest.mark.flaky(reruns=2)  # 8 ranks + daemons on 2 cores; ULFM can crash a rank in MPI_Init

STEPS, EXCLUDE_AT, READMIT_AT, RANK = 26, 6, 16, 3


def _run_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_demo(tmp_path_factory.mktemp("readmit"), "--steps", str(STEPS), "--no-slow", "--no-kill", "--no-adapt",
                    "--admin", f"{EXCLUDE_AT}:exclude --rank {RANK}", "--admin", f"{READMIT_AT}:readmit --rank {RANK}")


first_run, run = run_fixtures(_run_demo, "run")  # a rerun judges a fresh run


def test_the_operator_calls_were_accepted(run: Path) -> None:
    actions = json.loads((run / "demo.json").read_text())["operator_actions"]
    assert [(a["args"][0], a["ok"]) for a in actions] == [("exclude", True), ("readmit", True)], actions
    events = [e["event"] for e in jsonl(run / "events.jsonl")]
    assert "exclude" in events and "readmit" in events


def test_the_rank_leaves_as_a_spare_and_comes_back(run: Path) -> None:
    def ranks(plan: dict[str, Any]) -> set[int]:
        return set(Plan.from_dict(plan).ranks())

    commands = [e for e in jsonl(run / "events.jsonl") if e["event"] == "command" and e["kind"] == "reconfigure"]
    assert len(commands) == 2, commands
    assert RANK not in ranks(commands[0]["plan"]) and "ranks [3]" in commands[0]["reason"], commands[0]
    assert ranks(commands[1]["plan"]) == set(range(8)) and "ranks [3] recovered" in commands[1]["reason"], commands[1]
    recs = [r for r in jsonl(run / "progress.jsonl") if r["type"] == "reconfig"]
    assert [(r["kind"], r["epoch"]) for r in recs] == [("planned", 1), ("planned", 2)], recs
    out, back = recs
    assert EXCLUDE_AT < out["step"] <= READMIT_AT < back["step"], (out, back)
    assert back["bytes_moved"] > 0  # the readmitted rank held nothing: its state came over the wire


def test_every_step_once_and_the_loss_of_the_reference(run: Path) -> None:
    from resihp.report.cli import summarize

    steps = [r["step"] for r in jsonl(run / "progress.jsonl") if r["type"] == "step"]
    assert steps == list(range(STEPS)), steps  # no rollback: planned switches lose nothing
    s = summarize(run)
    assert s.reference_steps_compared == STEPS
    assert s.loss_delta_vs_reference is not None and s.loss_delta_vs_reference <= 1e-5, s.loss_delta_vs_reference
