"""``resihp report``: summary numbers of a synthetic run directory with known values, the
timeline PNG (with and without a trace), and the CLI's JSON and errors."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resihp.report.cli import ReportError, render_timeline, summarize
from resihp.report.data import load_run
from resihp.report.trace import predicted_times

T0 = 1_700_000_000.0
PLAN0, PLAN1, PLAN2 = "TP2xPP2xDP2 mb 4,4", "TP2xPP2xDP2 mb 5,3", "TP2xPP2xDP1 mb 8"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ref_loss(step: int) -> float:
    return 5.0 - 0.1 * step


def _loss(step: int) -> float:
    # relative deltas against the reference: 2 % at step 17 (the max), 0.5 % at the final step
    rel = {17: 0.02, 24: 0.005}.get(step, 0.001)
    return _ref_loss(step) * (1 + rel)


def _step(step: int, end: float, step_s: float, epoch: int, plan: str, tokens: int = 1000) -> dict[str, Any]:
    return {"type": "step", "step": step, "loss": _loss(step), "tokens": tokens, "time": T0 + end, "step_s": step_s,
            "epoch": epoch, "plan": plan}


def _write(path: Path, rows: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def make_run(run: Path, demo: bool = True, reference: bool = True) -> Path:
    """Healthy steps 0-9 (1 s each; step 0 carries 5000 tokens), a 2x fail-slow of rank 3
    injected at 10.5 s (steps 10-14 take 2 s), a planned reconfiguration (epoch 1) from step 15
    at 20.5 s (steps take 1.25 s), rank 5 killed at 27 s, a fail-stop recovery (epoch 2) at
    30 s that rolls back to step 19 (steps 19 and 20 run twice; 1.5 s each from then on)."""
    prog: list[Any] = [{"type": "start", "time": T0, "plan": PLAN0, "world": 8}]
    prog += [_step(i, 1.0 + i, 1.0, 0, PLAN0, tokens=5000 if i == 0 else 1000) for i in range(10)]
    prog += [_step(10 + i, 12.0 + 2 * i, 2.0, 0, PLAN0) for i in range(5)]
    prog.append({"type": "reconfig", "kind": "planned", "epoch": 1, "step": 15, "time": T0 + 20.5, "downtime_s": 0.5,
                 "bytes_moved": 3 * 1024 * 1024, "plan": PLAN1, "reason": "rank 3 slow"})
    prog += [_step(15 + i, 21.75 + 1.25 * i, 1.25, 1, PLAN1) for i in range(6)]  # 15..20, 19-20 are rolled back
    prog.append("{\"type\": \"step\", \"step\": 21, \"loss\": 3.")  # torn line
    prog.append({"type": "step", "step": 21, "loss": "nan?", "tokens": 1000, "time": T0 + 29.0})  # bad loss
    prog.append({"type": "reconfig", "kind": "fail-stop", "epoch": 2, "step": 19, "time": T0 + 30.0, "downtime_s": 3.0,
                 "bytes_moved": 1024, "plan": PLAN2, "reason": "rank 5 died"})
    prog += [_step(19 + i, 31.5 + 1.5 * i, 1.5, 2, PLAN2) for i in range(6)]  # 19..24
    prog.append({"type": "end", "time": T0 + 39.5, "step": 24})
    _write(run / "progress.jsonl", prog)
    ev = [
        {"event": "coordinator-started", "seq": 1, "time": T0 - 1.0, "job": "demo", "epoch": 0},
        {"event": "agent-registered", "seq": 2, "time": T0 - 0.5, "job": "demo", "node": "n0"},
        {"event": "finding", "seq": 3, "time": T0 + 5.0, "job": "demo", "kind": "fail-slow", "ranks": [3],
         "iteration": 4, "factor": 1.3},  # before the injection: not its detection
        {"event": "inject", "seq": 4, "time": T0 + 10.5, "job": "demo", "kind": "slow", "rank": 3, "factor": 2.0},
        {"event": "finding", "seq": 5, "time": T0 + 14.0, "job": "demo", "kind": "fail-slow", "ranks": [6],
         "iteration": 11, "factor": 1.5},  # another rank
        {"event": "finding", "seq": 6, "time": T0 + 15.2, "job": "demo", "kind": "fail-slow", "ranks": [3],
         "iteration": 12, "factor": 2.01, "cause": "compute", "reason": "rank 3 slow"},
        {"event": "finding", "seq": 7, "time": T0 + 15.3, "job": "demo", "kind": "fail-slow", "ranks": "3"},  # bad
        "not json at all",
        {"event": "decision", "seq": 8, "time": T0 + 15.4, "job": "demo", "act": True, "level": "dp", "reason": "x"},
        {"event": "command", "seq": 9, "time": T0 + 15.5, "job": "demo", "epoch": 1, "kind": "reconfigure",
         "apply_at": 15, "plan": {"tp": 2, "pp": 2, "dp": 2, "num_layers": 8, "global_microbatches": 8}, "reason": "x"},
        {"event": "some-future-event", "seq": 10, "time": T0 + 16.0, "job": "demo"},
        {"event": "plan-audit", "seq": 10, "time": T0 + 26.0, "job": "demo", "old_epoch": 0, "new_epoch": 1,
         "ratio": 0.63, "regret": False, "outcome": "kept"},
        {"event": "inject", "seq": 11, "time": T0 + 27.0, "job": "demo", "kind": "kill", "rank": 5},
        {"event": "finding", "seq": 12, "time": T0 + 28.4, "job": "demo", "kind": "fail-stop", "ranks": [5],
         "iteration": 20, "cause": "process-exit"},
    ]
    _write(run / "events.jsonl", ev)
    if demo:
        _write(run / "demo.json", [{"scenario": {"model": "tiny"}, "injections": [
            {"kind": "slow", "rank": 3, "factor": 2.0, "step": 10, "time": T0 + 10.5},
            {"kind": "kill", "rank": 5, "step": 21, "time": T0 + 27.0}]}])
    if reference:
        _write(run / "reference" / "progress.jsonl",
               [{"type": "step", "step": i, "loss": _ref_loss(i), "tokens": 1000, "time": T0 + i, "step_s": 1.0,
                 "epoch": 0, "plan": "TP1xPP1xDP1 mb 8"} for i in range(25)])
    return run


@pytest.mark.parametrize("demo", [True, False], ids=["demo.json", "events-only"])
def test_phases_latency_downtime_and_loss(tmp_path: Path, demo: bool) -> None:
    s = summarize(make_run(tmp_path / "run", demo=demo))
    assert s.injections_from == ("demo.json" if demo else "events.jsonl")
    by_key = {p.key: p for p in s.phases}
    assert list(by_key) == ["healthy", "fail-slow", "adapted", "fail-stop", "recovered"]
    assert by_key["healthy"].steps == tuple(range(10))
    assert by_key["fail-slow"].steps == tuple(range(10, 15))
    assert by_key["adapted"].steps == (15, 16, 17, 18)
    assert by_key["fail-stop"].steps == () and by_key["fail-stop"].tokens_per_s is None
    assert by_key["recovered"].steps == tuple(range(19, 25))
    # Σ tokens after the phase's first step / (last end − first end); step 0's 5000 tokens do not count
    assert by_key["healthy"].tokens_per_s == pytest.approx(9000 / 9.0)
    assert by_key["fail-slow"].tokens_per_s == pytest.approx(4000 / 8.0)
    assert by_key["adapted"].tokens_per_s == pytest.approx(3000 / 3.75)
    assert by_key["recovered"].tokens_per_s == pytest.approx(5000 / 7.5)
    assert (by_key["adapted"].epoch, by_key["adapted"].plan) == (1, PLAN1)
    assert (by_key["recovered"].epoch, by_key["recovered"].plan) == (2, PLAN2)
    assert by_key["fail-slow"].start_time_s == pytest.approx(10.5)
    assert s.tokens_per_s_overall == pytest.approx((5000 + 24 * 1000 - 5000) / 38.0)

    slow, kill = s.detections
    assert (slow.kind, slow.rank, slow.finding_ranks) == ("slow", 3, (3,))
    assert slow.latency_s == pytest.approx(15.2 - 10.5)
    assert slow.latency_iters == 2  # finding at iteration 12, the fault landed in step 10
    assert kill.latency_s == pytest.approx(28.4 - 27.0) and kill.finding_kind == "fail-stop"
    assert [r.downtime_s for r in s.reconfigs] == [0.5, 3.0]
    assert [r.bytes_moved for r in s.reconfigs] == [3 * 1024 * 1024, 1024]

    # steps 19 and 20 ran twice: the re-run (epoch 2) wins
    assert s.steps == 25 and s.reruns == 2 and s.epochs == [0, 1, 2]
    assert s.final_loss == pytest.approx(_loss(24))
    assert s.reference_final_loss == pytest.approx(_ref_loss(24))
    assert s.final_loss_rel_delta == pytest.approx(0.005)
    assert s.loss_delta_vs_reference == pytest.approx(0.02)
    assert s.reference_steps_compared == 25

    d = s.to_dict()
    assert d["tokens_per_s"]["fail-slow"] == pytest.approx(500.0)
    assert d["detect_latency_s_slow"] == pytest.approx(4.7) and d["detect_latency_s_stop"] == pytest.approx(1.4)
    assert d["downtime_s"] == [0.5, 3.0]
    assert d["phases"][1] | {"label": ""} == {
        "key": "fail-slow", "label": "", "start_time_s": pytest.approx(10.5), "first_step": 10, "last_step": 14,
        "n_steps": 5, "tokens_per_s": pytest.approx(500.0), "epoch": 0, "plan": PLAN0}
    json.dumps(d)  # serialisable as is


def test_rerun_last_line_wins_and_malformed_lines_are_counted(tmp_path: Path) -> None:
    data = load_run(make_run(tmp_path / "run"))
    step19 = next(r for r in data.progress.steps if r.step == 19)
    assert (step19.epoch, step19.time, step19.plan) == (2, T0 + 31.5, PLAN2)
    assert [r.step for r in data.progress.steps] == list(range(25))
    assert data.skipped == {"progress.jsonl": 2, "events.jsonl": 2}
    assert data.t0 == T0
    assert [(c.epoch, c.apply_at, c.plan) for c in data.commands] == [(1, 15, "TP2xPP2xDP2 mb 4,4")]


def test_no_reference_no_events(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", demo=False, reference=False)
    (run / "events.jsonl").unlink()
    with (run / "progress.jsonl").open("a") as fh:
        fh.write(json.dumps({"type": "stopped", "time": T0 + 40, "rank": 2, "step": 24, "reason": "no shard left"}) + "\n")
    s = summarize(run)
    assert s.stopped == "rank 2 at step 24: no shard left"
    assert s.detections == [] and s.injections_from == "none"
    assert s.reference_final_loss is None and s.loss_delta_vs_reference is None
    # without injections the phases are cut at the reconfigurations only
    assert [p.key for p in s.phases] == ["healthy", "adapted", "recovered"]
    assert s.phases[0].tokens_per_s == pytest.approx((5000 + 14 * 1000 - 5000) / 19.0)


def test_timeline_png_without_trace(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    pred = predicted_times(run / "trace.jsonl")
    assert pred.predicted_s == [] and "no trace.jsonl" in pred.note
    out = render_timeline(run, tmp_path / "out" / "t.png")
    blob = out.read_bytes()
    assert blob[:8] == PNG_MAGIC and len(blob) > 20_000


def test_predicted_time_from_a_real_trace(tmp_path: Path) -> None:
    from resihp.coordinator.detector.detector import DetectorConfig
    from resihp.coordinator.model.plan import Plan
    from resihp.coordinator.model.spec import preset
    from resihp.sim.workload import Fault, Noise, WorkloadConfig, write_workload

    run = make_run(tmp_path / "run")
    cfg = WorkloadConfig(preset("llama2-7b"), Plan.uniform(2, 2, 2, 32, 8), budget=8192, seed=4, iterations=25,
                         noise=Noise.quiet(), faults=(Fault("compute", 3, 12, 2.0),))
    write_workload(cfg, str(run / "trace.jsonl"))
    pred = predicted_times(run / "trace.jsonl")
    warm = DetectorConfig().warmup_iters
    assert pred.traced == 25
    assert pred.iterations == list(range(warm, 25))
    assert len(pred.predicted_s) == len(pred.observed_s) == 25 - warm
    assert all(math.isfinite(p) and p > 0 for p in pred.predicted_s)
    # the prediction is the healthy cost: the 2x slow iterations are observed well above it
    slow = [o / p for i, p, o in zip(pred.iterations, pred.predicted_s, pred.observed_s) if i >= 14]
    assert min(slow) > 1.4
    blob = render_timeline(run, None, predicted=pred).read_bytes()
    assert (run / "timeline.png").exists() and blob[:8] == PNG_MAGIC

    # a killed job's torn last line: the records before it still count
    lines = (run / "trace.jsonl").read_text().splitlines()
    last = max(i for i, text in enumerate(lines) if '"iteration"' in text and '"seqlens"' in text)
    torn = run / "torn.jsonl"
    torn.write_text("\n".join(lines[:last]) + "\n" + lines[last][: len(lines[last]) // 2])
    cut = predicted_times(torn)
    assert "stopped reading" in cut.note and 0 < len(cut.predicted_s) < len(pred.predicted_s)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resihp.cli", "report", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_json_and_table(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    proc = _cli(str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["tokens_per_s"]["healthy"] == pytest.approx(1000.0)
    assert obj["tokens_per_s"]["recovered"] == pytest.approx(5000 / 7.5)
    assert obj["detect_latency_s_slow"] == pytest.approx(4.7)
    assert obj["detect_latency_iters_slow"] == 2
    assert obj["final_loss"] == pytest.approx(_loss(24))
    assert obj["loss_delta_vs_reference"] == pytest.approx(0.02)
    assert obj["steps"] == 25 and obj["epochs"] == [0, 1, 2]
    assert obj["audits"] == {"1": "x0.63 kept"}  # the plan audit's verdict on epoch 1's switch
    assert "no trace.jsonl" in obj["trace_note"]
    assert Path(obj["png"]).read_bytes()[:8] == PNG_MAGIC
    assert "skipped 2 malformed line(s) of progress.jsonl" in proc.stderr

    proc = _cli(str(run), "--no-png")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "after fail-slow x2 on rank 3 (before adaptation)" in out
    assert "after kill + recovery (epoch 2)" in out
    assert "4.70 s (2 iterations)" in out and "3.0 MiB" in out
    assert "x0.63 kept" in out and "audit" in out
    assert "relative delta 0.500 %" in out and "max relative delta over 25 common steps 2.000 %" in out


def test_cli_missing_run_dir_or_progress_exit_2(tmp_path: Path) -> None:
    proc = _cli(str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "does not exist" in proc.stderr and "resihp demo" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = _cli(str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert "progress.jsonl" in proc.stderr and "resihp demo" in proc.stderr
    with pytest.raises(ReportError, match="no step lines"):
        _write(tmp_path / "empty" / "progress.jsonl", [{"type": "start", "time": T0, "plan": "x", "world": 1}])
        summarize(tmp_path / "empty")


def test_summary_needs_no_matplotlib_torch_or_grpc(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('matplotlib', 'torch', 'grpc', 'mpi4py'):\n"
        "            raise ImportError(name + ' imported')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from resihp.report.cli import main\n"
        f"sys.exit(main([{str(run)!r}, '--no-png', '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["png"] is None and obj["tokens_per_s"]["adapted"] == pytest.approx(800.0)
