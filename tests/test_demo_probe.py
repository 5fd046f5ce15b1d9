"""A slow rank the plan left idle is taken back on the evidence of its compute probes.

``resihp demo`` (8 ranks TP2 x PP2 x DP2 under ``resihp launch``: coordinator, agent, store,
mpirun with ULFM): rank 2's compute is throttled 3x at step 8; the detector finds it and
the re-plan leaves it idle as a spare. At step 50 the operator clears the throttle
(``resihp admin inject slow --rank 2 --factor 1``). Nothing runs on an idle rank, so only
its probes (a few GEMMs every second here, ``--probe-every-s 1``; trainer_hooks/runtime/probe.py)
can show the device is healthy again: the detector reports it recovered from them — not
from a lapse of its verdict (``spare_verdict_s``, 10 min) — and the coordinator re-plans on
that (whether the readmission then stays is the plan audit's call: on these shared cores a
readmitted eighth rank can measure slower, and the audit undoes it). Every step is trained
once and the loss is the uninterrupted reference's.

The operator pins ``policy profile=configured`` at step 2, as tests/test_demo_idle_kill.py
does: the measured profile is fitted from the first iterations on these shared cores, so the
planner's answer to the throttle varies with the machine's load then, and the test is of the
probe path, which needs rank 2 left idle. (In one of ten runs here with the measured profile,
right after the four-node namespace test, rank 2 sent no idle probe before the clear; in the
other nine the re-plan left ranks 2 and 7 idle, as with the configured profile.)
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from demo_run import jsonl, run_demo
from fresh_rerun import run_fixtures

pytestmark = pytest.mark.flaky(reruns=2)  # 8 ranks + daemons on 2 cores; ULFM can crash a rank in MPI_Init

STEPS, SLOW_AT, CLEAR_AT, RANK = 150, 8, 50, 2


def _run_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_demo(tmp_path_factory.mktemp("probe"), "--steps", str(STEPS), "--slow-at", str(SLOW_AT),
                    "--slow-factor", "3", "--slow-rank", str(RANK), "--no-kill", "--probe-every-s", "1",
                    "--admin", "2:policy profile=configured", "--admin", f"{CLEAR_AT}:inject slow --rank {RANK} --factor 1")


# a rerun judges a fresh demo run (the probes time GEMMs on 2 shared cores: one CI run read the
# 3x throttle at 1.97x, under the test's 2.0, on all three tries of the same recording)
first_run, run = run_fixtures(_run_demo, "run")


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in jsonl(run / "events.jsonl") if e["event"] == kind]


def test_the_slow_rank_is_left_idle_then_recovered_by_its_probes(run: Path) -> None:
    findings = [f for f in _events(run, "finding") if RANK in f["ranks"]]
    assert [f["kind"] for f in findings] == ["fail-slow", "recovered"], findings
    first_plan = _events(run, "command")[0]["plan"]
    assert RANK in first_plan["spares"], first_plan  # the re-plan left it idle
    back = findings[1]
    assert "compute probes" in back["reason"] and "lapsed" not in back["reason"], back
    assert back["evidence"]["ratio"] <= 1.5 and back["evidence"]["probes"] == 3.0, back  # the demo's probe_threshold
    actions = json.loads((run / "demo.json").read_text())["operator_actions"]
    assert [a["ok"] for a in actions] == [True, True], actions
    injected = [e for e in _events(run, "inject") if e.get("factor") == 1.0]
    assert injected and back["time"] > injected[0]["time"], (injected, back)
    # the coordinator re-planned on the recovery (whether a new layout pays is the planner's call)
    decisions = [d for d in _events(run, "decision") if d["time"] >= back["time"]]
    assert decisions and f"ranks [{RANK}] recovered" in decisions[0]["reason"], decisions


def test_the_idle_ranks_probes_read_its_throttle_until_it_is_cleared(run: Path) -> None:
    probes = _events(run, "probe")
    # every other rank probed once at start-up (a member probes again when a re-plan brings it
    # back from idle: the readmission may take a spare beside rank 2, so count epoch 0 only)
    startup = [p["probe_s"] for p in probes if p["epoch"] == 0 and not p["idle"] and p["rank"] != RANK]
    assert len(startup) == 7, probes
    ref = statistics.median(startup)
    clear = [e for e in _events(run, "inject") if e.get("factor") == 1.0][0]["time"]
    mine = [p for p in probes if p["idle"] and p["rank"] == RANK]
    back = [f for f in _events(run, "finding") if f["kind"] == "recovered" and RANK in f["ranks"]][0]["time"]
    slow = [p["probe_s"] / ref for p in mine if p["time"] < clear]
    # the probes that judged the recovery (a readmission the plan audit undoes makes it idle again)
    after = [p["probe_s"] / ref for p in mine if clear < p["time"] <= back]
    # the 3x throttle stretches the probe as it stretches a compute chunk (measured 2.8-2.9x)
    assert slow and min(slow) >= 2.0, (slow, ref, _events(run, "command")[0]["plan"])
    assert len(after) >= 3 and max(after[-3:]) <= 1.5, (after, ref)


def test_every_step_once_and_the_loss_of_the_reference(run: Path) -> None:
    from resihp.report.cli import summarize

    steps = [r["step"] for r in jsonl(run / "progress.jsonl") if r["type"] == "step"]
    assert steps == list(range(STEPS)), steps  # planned switches only: nothing re-run
    s = summarize(run)
    assert s.reference_steps_compared == STEPS
    assert s.loss_delta_vs_reference is not None and s.loss_delta_vs_reference <= 1e-5, s.loss_delta_vs_reference
