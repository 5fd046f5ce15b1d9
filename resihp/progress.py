"""The demo's live progress: a tqdm bar on a terminal, plain lines everywhere else.

``bar``: a tqdm bar whose postfix shows step, loss, tokens/s, epoch and, where the terminal
is wide enough, the latest event; each event is also written above the bar as a line of its
own (``tqdm.write``), so it stays in the scroll-back. ``plain``: no
control characters at all (CI logs, ``| tee``): one line every ``every_steps`` steps (and for
the last step), one line per event. ``off``: nothing. ``auto``: ``bar`` when the stream is a
terminal, ``plain`` otherwise. The stream and the is-a-terminal flag are injectable, so both
forms are testable without a terminal.

Plain lines (``T`` is seconds since the job started)::

    T.Ts  step  NN/TOTAL  loss L.LLL  RATE tok/s  epoch E  PLAN
    T.Ts  EVENT TEXT
"""
from __future__ import annotations

import os
import re
import sys
from typing import Literal, NoReturn, TextIO

from tqdm import tqdm

Mode = Literal["auto", "bar", "plain", "off"]
MODES: tuple[Mode, ...] = ("auto", "bar", "plain", "off")
DEFAULT_EVERY_STEPS = 10  # plain mode: a 70-step demo run logs 7 step lines, plus its events

_BAR_MIN_COLUMNS = 34  # "100%|" + a bar of at least 20 + "| 01:23, "

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _clean(text: str) -> str:
    """One line with no control characters (a reason string could carry a newline or an escape)."""
    return _CONTROL.sub(" ", text)


def resolve_mode(mode: Mode, is_tty: bool) -> Mode:
    """``auto`` → ``bar`` on a terminal, ``plain`` otherwise; any other mode stands."""
    if mode == "auto":
        return "bar" if is_tty else "plain"
    return mode


class Progress:
    """Shows a job's steps and events on ``stream``; ``close()`` when the job ends."""

    def __init__(self, total: int, *, mode: Mode = "auto", stream: TextIO | None = None,
                 is_tty: bool | None = None, every_steps: int = DEFAULT_EVERY_STEPS) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.stream: TextIO = stream if stream is not None else sys.stdout
        tty = is_tty if is_tty is not None else _isatty(self.stream)
        self.mode: Mode = resolve_mode(mode, tty)
        self.total = total
        self.every_steps = every_steps
        self._pending: str | None = None  # plain: the latest step line not yet written
        self._last_step: int | None = None
        self._event = ""  # bar: the latest event's text
        self._stats = f"step 0/{total}"  # bar: the latest step's numbers
        self._bar: tqdm[NoReturn] | None = None  # no iterable: the stubs type it so
        if self.mode == "bar":
            # follow the terminal's size; a pseudo-terminal that reports none (0 x 0: tqdm would
            # then hide the bar) gets 100 x 24
            sized = tty and _columns(self.stream) > 0
            self._bar = tqdm(total=total, file=self.stream, dynamic_ncols=sized, ncols=None if sized else 100,
                             nrows=None if sized else 24, leave=True,
                             bar_format="{percentage:3.0f}%|{bar}| {elapsed}{postfix}")

    def step(self, step: int, loss: float, tokens_per_s: float, *, epoch: int = 0, plan: str = "",
             elapsed_s: float = 0.0) -> None:
        """Step ``step`` (0-based) finished with ``loss``."""
        n = step + 1
        if self._bar is not None:
            self._bar.n = min(n, self.total)
            self._stats = f"step {n}/{self.total}  loss {loss:.3f}  {tokens_per_s:.0f} tok/s  epoch {epoch}"
            self._render(self._bar)
        elif self.mode == "plain":
            if n == self._last_step:  # the same step reported again: nothing new
                return
            self._last_step = n
            line = (f"{elapsed_s:7.1f}s  step {n:3d}/{self.total}  loss {loss:6.3f}  {tokens_per_s:6.0f} tok/s  "
                    f"epoch {epoch}  {_clean(plan)}").rstrip()
            if n % self.every_steps == 0 or n >= self.total:
                self._write(line)
                self._pending = None
            else:
                self._pending = line

    def event(self, text: str, *, elapsed_s: float = 0.0) -> None:
        """A finding, a re-plan, a reconfiguration, an injected fault: one line of its own."""
        text = _clean(text)
        line = f"{elapsed_s:7.1f}s  {text}"
        if self._bar is not None:
            self._event = text
            tqdm.write(line, file=self.stream)
            self._render(self._bar)
        elif self.mode == "plain":
            self._write(line)

    def close(self) -> None:
        """Ends the bar's line; in plain mode writes the last step if no line showed it yet."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _render(self, bar: tqdm[NoReturn]) -> None:
        """The bar's postfix: the last step's numbers, then the latest event where the line has room
        for it (its full line is above the bar)."""
        postfix = self._stats
        room = (bar.ncols or 100) - len(postfix) - _BAR_MIN_COLUMNS
        if self._event and room >= 12:
            postfix += "  | " + (self._event if len(self._event) <= room - 4 else self._event[: room - 7] + "...")
        bar.set_postfix_str(postfix, refresh=True)

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def _columns(stream: TextIO) -> int:
    """The terminal's width in columns, or 0 where it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        return 0


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or a stream-like object
        return False
