"""The demo's progress display: plain lines off a terminal, a tqdm bar on one."""
from __future__ import annotations

import io
import re

import pytest

from resihp.progress import Progress, resolve_mode


def _feed(shown: Progress, steps: int) -> None:
    """A 12-step run: an injected fault after step 3, a reconfiguration after step 5."""
    for s in range(steps):
        shown.step(s, 5.0 - 0.25 * s, 1000.0 + s, epoch=0 if s < 5 else 1, plan="TP2xPP2xDP2",
                   elapsed_s=float(s + 1))
        if s == 3:
            shown.event("INJECT   slow rank 2 x2.0", elapsed_s=4.5)
        if s == 5:
            shown.event("RECONFIGURED (planned) epoch 1\nin 0.20 s\x1b[31m", elapsed_s=6.5)
    shown.close()


def test_plain_mode_writes_a_line_every_n_steps_one_per_event_and_the_last_step() -> None:
    out = io.StringIO()
    shown = Progress(12, mode="auto", stream=out, is_tty=False, every_steps=4)
    assert shown.mode == "plain"
    _feed(shown, 12)
    assert out.getvalue().splitlines() == [
        "    4.0s  step   4/12  loss  4.250    1003 tok/s  epoch 0  TP2xPP2xDP2",
        "    4.5s  INJECT   slow rank 2 x2.0",
        "    6.5s  RECONFIGURED (planned) epoch 1 in 0.20 s [31m",
        "    8.0s  step   8/12  loss  3.250    1007 tok/s  epoch 1  TP2xPP2xDP2",
        "   12.0s  step  12/12  loss  2.250    1011 tok/s  epoch 1  TP2xPP2xDP2",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_plain_mode_shows_the_last_step_of_a_job_that_ends_early_once() -> None:
    out = io.StringIO()
    shown = Progress(70, mode="plain", stream=out, is_tty=True, every_steps=10)
    for s in range(13):
        shown.step(s, 4.0, 900.0, epoch=2, plan="TP1xPP2xDP2", elapsed_s=2.0 * s)
    shown.step(12, 4.0, 900.0, epoch=2, plan="TP1xPP2xDP2", elapsed_s=25.0)  # reported again: no line
    shown.close()
    shown.close()
    assert out.getvalue().splitlines() == [
        "   18.0s  step  10/70  loss  4.000     900 tok/s  epoch 2  TP1xPP2xDP2",
        "   24.0s  step  13/70  loss  4.000     900 tok/s  epoch 2  TP1xPP2xDP2",
    ]


def test_off_writes_nothing() -> None:
    out = io.StringIO()
    _feed(Progress(12, mode="off", stream=out, is_tty=True), 12)
    assert out.getvalue() == ""


def test_bar_mode_shows_step_loss_and_rate_and_writes_events_on_their_own_lines() -> None:
    out = io.StringIO()
    shown = Progress(12, mode="auto", stream=out, is_tty=True)
    assert shown.mode == "bar"
    _feed(shown, 12)
    text = out.getvalue()
    assert "\r" in text  # a live bar redraws its line
    frames = [f for f in re.split(r"[\r\n]", text) if f.strip()]
    last = [f for f in frames if "12/12" in f][-1]
    assert "100%" in last and "step 12/12  loss 2.250  1011 tok/s  epoch 1" in last
    assert "  | RECONFIGURED (pl" in last  # the latest event, cut to the 100 columns of a sizeless stream
    assert len(last) <= 100
    lines = text.split("\n")  # tqdm.write clears the bar (\r...\r) and writes the event as a line of its own
    assert any(line.rsplit("\r", 1)[-1] == "    4.5s  INJECT   slow rank 2 x2.0" for line in lines)
    assert any(line.rsplit("\r", 1)[-1].startswith("    6.5s  RECONFIGURED (planned)") for line in lines)
    assert text.endswith("\n")  # close() ends the bar's line


def test_modes_resolve_by_terminal_and_bad_arguments_are_refused() -> None:
    assert resolve_mode("auto", True) == "bar"
    assert resolve_mode("auto", False) == "plain"
    assert resolve_mode("bar", False) == "bar"
    assert resolve_mode("plain", True) == "plain"
    with pytest.raises(ValueError, match="every_steps"):
        Progress(10, stream=io.StringIO(), every_steps=0)
    with pytest.raises(ValueError, match="total"):
        Progress(0, stream=io.StringIO())


def test_a_stream_that_is_not_a_terminal_gets_plain_lines_by_default() -> None:
    out = io.StringIO()  # StringIO.isatty() is False
    assert Progress(5, stream=out).mode == "plain"
