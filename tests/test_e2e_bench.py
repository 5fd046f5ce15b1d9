"""The pure parts of bench/e2e.py and bench/e2e_restart.py (the benchmark itself is not run here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import e2e  # noqa: E402
import e2e_restart  # noqa: E402


def _step(step: int, end: float, step_s: float = 1.0, tokens: int = 100, loss: float = 5.0) -> dict[str, object]:
    return {"type": "step", "step": step, "time": end, "step_s": step_s, "tokens": tokens, "loss": loss,
            "epoch": 0, "plan": "TP2xPP2xDP2 mb 4,4"}


def test_whole_run_counts_each_step_once_and_keeps_the_downtime() -> None:
    # segment 0: steps 0..6 end at t=1..7; crash; segment 1 resumes at 5 (checkpoint after 4):
    # steps 5, 6 re-done, then 7; the relaunch gap (7 -> 20) counts
    lines = [{"type": "start", "time": 0.0}] + [_step(s, s + 1.0) for s in range(7)]
    lines += [{"type": "start", "time": 15.0}, _step(5, 20.0), _step(6, 21.0), _step(7, 22.0)]
    w = e2e.whole_run(lines)
    assert w["steps"] == 8
    assert w["reruns"] == 2
    assert w["tokens"] == 800
    assert w["seconds"] == pytest.approx(22.0)  # from step 0's start (1 - 1) to step 7's end
    assert w["tokens_per_s"] == pytest.approx(800 / 22.0)


def test_whole_run_of_nothing() -> None:
    assert e2e.whole_run([{"type": "start", "time": 1.0}])["tokens_per_s"] is None


def test_window_rate_is_steady_state_between_two_times() -> None:
    lines = [_step(s, float(s), tokens=100) for s in range(10)]
    # steps ending in (2, 6]: 3, 4, 5, 6 -> tokens after the first (300) over 6 - 3
    assert e2e.window_rate(lines, 2.0, 6.0) == pytest.approx(100.0)
    assert e2e.window_rate(lines, 5.5, 6.0) is None  # one step: no rate


def test_bound_formula_and_ratios() -> None:
    assert e2e.healthy_fraction(8, 1, 2.0) == pytest.approx(7.5 / 8)
    assert e2e.healthy_fraction(8, 0, 2.0) == 1.0
    assert e2e.retained_vs_bound(900.0, 1000.0, 7.5 / 8) == pytest.approx(0.96)
    assert e2e.retained_vs_bound(None, 1000.0, 0.9) is None
    assert e2e.ratio(3.0, 2.0) == 1.5 and e2e.ratio(3.0, None) is None
    with pytest.raises(ValueError, match="slow_ranks"):
        e2e.healthy_fraction(8, 9, 2.0)


def test_restart_decision_from_events() -> None:
    slow = {"event": "finding", "kind": "fail-slow", "ranks": [2]}
    stop = {"event": "finding", "kind": "fail-stop", "ranks": [5]}
    other = [{"event": "agent-registered"}, {"event": "finding", "kind": "recovered", "ranks": [2]}]
    assert e2e_restart.restart_reason(other, "restart") is None
    assert e2e_restart.restart_reason(other + [slow], "restart") == "fail-slow"
    assert e2e_restart.restart_reason(other + [slow], "static") is None  # static lives with a fail-slow
    assert e2e_restart.restart_reason([stop], "static") == "fail-stop"
    assert e2e_restart.restart_reason([stop, slow], "restart") == "fail-stop"
    with pytest.raises(ValueError, match="unknown policy"):
        e2e_restart.restart_reason([], "resihp")


def test_merge_segments_writes_one_run(tmp_path: Path) -> None:
    run = e2e_restart.RestartRun("static", str(tmp_path))
    for k, (steps, t) in enumerate([(range(0, 7), 100.0), (range(5, 8), 200.0)]):
        seg = tmp_path / f"seg-{k:02d}"
        seg.mkdir()
        prog = [{"type": "start", "time": t}] + [_step(s, t + s) for s in steps]
        (seg / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prog))
        (seg / "events.jsonl").write_text(json.dumps({"event": "coordinator-started", "time": t - 1}) + "\n")
        run.segments.append(e2e_restart.Segment(k, str(seg), t - 5, steps[0]))
    run.injections = [{"kind": "kill", "rank": 5, "step": 6, "time": 106.5, "ok": True},
                      {"kind": "slow", "rank": 2, "step": 1, "time": 101.5, "ok": False}]
    e2e_restart.merge_segments(run)
    lines = e2e.read_jsonl(tmp_path / "progress.jsonl")
    assert [x["time"] for x in lines if x["type"] == "start"] == [100.0]  # the first segment's start only
    assert len(e2e.step_lines(lines)) == 10
    demo = json.loads((tmp_path / "demo.json").read_text())
    assert [i["kind"] for i in demo["injections"]] == ["kill"]  # failed injections are not reported
    assert len(e2e.read_jsonl(tmp_path / "events.jsonl")) == 2
    from resihp.report.summary import summarize

    s = summarize(tmp_path)
    assert s.steps == 8 and s.reruns == 2


def test_launch_command_is_static_and_resumes(tmp_path: Path) -> None:
    cfg = e2e_restart.RestartConfig(steps=30, checkpoint_every=5)
    cmd = e2e_restart.launch_command(tmp_path / "seg-01", tmp_path / "ckpt", cfg, resume=True)
    assert "--coordinator-arg=--no-auto-reconfigure" in cmd
    train = cmd[cmd.index("--") + 1:]
    assert "--no-resilience" in train and "--resume" in train
    assert train[train.index("--checkpoint-every") + 1] == "5"
    assert train[train.index("--checkpoint-dir") + 1] == str(tmp_path / "ckpt")
    assert json.loads((tmp_path / "seg-01" / "profile" / "cluster.json").read_text())["device_flops"] > 0


def test_startup_failure_is_seen_in_the_launch_log(tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    assert not e2e_restart.startup_failed(log)  # no log yet: still starting
    log.write_text("resihp launch: job j, run dir d\n  coordinator 127.0.0.1:1\n")
    assert not e2e_restart.startup_failed(log)
    log.write_text(log.read_text() + "Traceback (most recent call last):\n"
                   "mpi4py.MPI.Exception: MPI_ERR_PROC_FAILED: Process Failure\n")
    assert e2e_restart.startup_failed(log)


def test_detection_latency_runs_from_the_coordinators_inject_event() -> None:
    events = [
        {"event": "inject", "kind": "slow", "rank": 2, "time": 10.0},
        {"event": "finding", "kind": "fail-slow", "ranks": [6], "time": 11.0},  # another rank: not it
        {"event": "finding", "kind": "fail-slow", "ranks": [2, 3], "time": 14.5},
        {"event": "finding", "kind": "fail-stop", "ranks": [5], "time": 19.0},  # before its injection
        {"event": "inject", "kind": "kill", "rank": 5, "time": 20.0},
        {"event": "finding", "kind": "fail-stop", "ranks": [5], "time": 20.25},
        {"event": "inject", "kind": "slow", "rank": 2, "time": 40.0},  # a repeat: the first one counts
    ]
    assert e2e.detection_latencies(events) == {"slow": pytest.approx(4.5), "kill": pytest.approx(0.25)}
    assert e2e.detection_latencies(events[:2]) == {"slow": None}


def test_adapted_window_runs_from_the_first_replan_to_the_kill() -> None:
    lines = [_step(s, float(s)) for s in range(10)]
    lines.insert(4, {"type": "reconfig", "kind": "planned", "time": 3.5, "step": 4})
    lines.insert(8, {"type": "reconfig", "kind": "planned", "time": 6.2, "step": 7})  # a later re-plan: inside
    lines.append({"type": "reconfig", "kind": "fail-stop", "time": 9.5, "step": 10})
    # steps ending in (3.5, 8.0]: 4..8 -> 400 tokens after step 4 over 8 - 4
    assert e2e.adapted_window(lines, slow_t=1.0, kill_t=8.0) == (pytest.approx(100.0), True)
    assert e2e.adapted_window(lines, slow_t=7.0, kill_t=8.0) == (None, False)  # no re-plan after the slow
    assert e2e.adapted_window(lines, slow_t=1.0, kill_t=2.0) == (None, False)  # re-planned only after the kill


def test_restart_gaps_skip_segments_that_never_started() -> None:
    segs = [{"first_step_end": 10.0, "last_step_end": 50.0, "last_step": 43, "resumed_at": 0,
             "end_reason": "fail-stop"},
            {"first_step_end": None, "last_step_end": None, "last_step": -1, "resumed_at": 40,
             "end_reason": "start-up failure"},
            {"first_step_end": 90.0, "last_step_end": 120.0, "last_step": 69, "resumed_at": 40,
             "end_reason": "finished"}]
    assert e2e.restart_gaps(segs) == [{"after_step": 43, "reason": "fail-stop", "lost_s": 40.0, "redone": 4}]


def test_the_restart_driver_starts_and_relaunches_at_the_given_layout(tmp_path: Path) -> None:
    cfg = e2e_restart.RestartConfig(steps=10, layout="TP1xPP2xDP4")
    cmd = e2e_restart.launch_command(tmp_path / "seg-00", tmp_path / "ckpt", cfg, resume=False)
    split = cmd.index("--")
    launch, train = cmd[:split], cmd[split + 1:]
    for part in (launch, train):
        joined = " ".join(part)
        assert "--tp 1 --pp 2 --dp 4" in joined
    assert launch[launch.index("-n") + 1] == "8"
    with pytest.raises(Exception, match="expected TPaxPPbxDPc"):
        e2e_restart.launch_command(tmp_path / "s", tmp_path / "c", e2e_restart.RestartConfig(layout="DP8"), False)


def test_a_window_rates_noise_is_its_per_step_spread_over_root_n() -> None:
    even = [_step(s, float(s)) for s in range(10)]  # 100 tokens every second: no spread
    assert e2e.rate_relative_se(even, -1.0, 20.0) == pytest.approx(0.0)
    jitter = [_step(0, 0.0), _step(1, 1.0), _step(2, 3.0), _step(3, 4.0), _step(4, 6.0)]  # rates 100, 50, 100, 50
    assert e2e.rate_relative_se(jitter, -1.0, 20.0) == pytest.approx((28.8675 / 75.0) / 2.0, rel=1e-3)
    assert e2e.rate_relative_se(even[:3], -1.0, 20.0) is None  # two rates: no spread to speak of


def test_the_predictors_error_after_a_replan_is_read_from_the_third_iteration_on() -> None:
    its = list(range(40))
    observed = [1.0] * 40
    # healthy start 10 % off; after the change at 20: 50 % off for 3 iterations, 8 % until 30, 2 % after
    predicted = [1.1] * 20 + [1.5] * 3 + [1.08] * 7 + [1.02] * 10
    got = e2e.itp_errors(its, predicted, observed, [20], healthy_until=14)
    assert got["itp_error_healthy"] == pytest.approx(0.1)
    assert got["post_replan_itp_error_3"] == pytest.approx(0.08)
    assert got["post_replan_itp_error_10"] == pytest.approx(0.02)
    assert got["post_replan_unpriced_3"] == 0
    # iterations the predictor did not price after the change are counted, not hidden
    gap = [i for i in its if not 23 <= i < 26]
    got = e2e.itp_errors(gap, [predicted[i] for i in gap], [1.0] * len(gap), [20], healthy_until=14)
    assert got["post_replan_unpriced_3"] == 3 and got["post_replan_itp_error_3"] == pytest.approx(0.08)
    assert e2e.itp_errors(its, predicted, observed, [], 14)["post_replan_itp_error_3"] is None
