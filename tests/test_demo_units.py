"""resihp demo's driver pieces that need no job: operator actions and a failed start set aside."""
from __future__ import annotations

from pathlib import Path

import pytest

from resihp.demo import _admin_action, _set_aside


def test_admin_action_parses_step_and_arguments() -> None:
    assert _admin_action("20:exclude --rank 3") == {"kind": "admin", "args": ["exclude", "--rank", "3"], "step": 20}


@pytest.mark.parametrize("text", ["exclude --rank 3", "x:exclude", "20:", " :readmit --rank 1"])
def test_admin_action_refuses_malformed_text_and_says_the_form(text: str) -> None:
    with pytest.raises(SystemExit, match=r"--admin wants STEP:ARGS, e.g. '20:exclude --rank 3'"):
        _admin_action(text)


def test_a_failed_start_is_set_aside_so_the_retry_starts_clean(tmp_path: Path) -> None:
    # the coordinator's journal of the failed start must not be resumed by the retry's coordinator
    for name in ("journal.jsonl", "events.jsonl", "launch.log", "token"):
        (tmp_path / name).write_text(name)
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "cluster.json").write_text("{}")
    _set_aside(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed-start", "profile"]
    assert sorted(p.name for p in (tmp_path / "failed-start").iterdir()) == [
        "events.jsonl", "journal.jsonl", "launch.log", "token"]
    assert (tmp_path / "failed-start" / "journal.jsonl").read_text() == "journal.jsonl"
    assert (tmp_path / "profile" / "cluster.json").exists()


def test_the_demo_kills_rank_5_or_a_rank_that_holds_state() -> None:
    from resihp.demo import _kill_target

    assert _kill_target(list(range(8)), 2) == 5
    assert _kill_target([0, 1, 3, 4], 2) == 4  # the re-plan left 2, 5, 6, 7 idle
    assert _kill_target([0, 1, 2], 2) == 1  # never the throttled rank while another holds state
    assert _kill_target([2], 2) == 2
    assert _kill_target([0, 3, 4, 6], None) == 6


def test_the_demo_shows_events_and_reconfigurations_as_one_line_each() -> None:
    from resihp.demo import _event_text, _reconfig_text, _tokens_per_s

    assert _event_text({"event": "inject", "kind": "slow", "rank": 2, "factor": 2.0}) == "INJECT   slow rank 2 x2.0"
    assert _event_text({"event": "finding", "kind": "fail-slow", "ranks": [2], "cause": "compute",
                        "factor": 1.93}) == "DETECTED fail-slow on ranks [2] (compute, x1.93)"
    assert _event_text({"event": "heartbeat"}) is None
    assert _reconfig_text({"kind": "planned", "epoch": 1, "downtime_s": 0.2, "bytes_moved": 29e6,
                           "plan": "TP1xPP2xDP2", "step": 18}) == (
        "RECONFIGURED (planned) epoch 1 in 0.20 s, 29.00 MB moved: TP1xPP2xDP2; resuming at step 18")
    assert _tokens_per_s([(10.0, 1024), (11.0, 1024), (12.0, 1024)]) == 1024.0
    assert _tokens_per_s([(10.0, 1024)]) == 0.0


def test_the_demo_progress_options() -> None:
    from resihp.demo import _parser

    args = _parser().parse_args([])
    assert (args.progress, args.progress_every, args.quiet) == ("auto", 10, False)
    args = _parser().parse_args(["--progress", "plain", "--progress-every", "5"])
    assert (args.progress, args.progress_every) == ("plain", 5)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--progress", "fancy"])
