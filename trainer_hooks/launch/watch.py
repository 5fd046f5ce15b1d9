"""What ``resihp launch`` watches while a job runs, and how it tells the user how it ended.

``JobFinishedWatch`` follows the coordinator's event log (every rank said goodbye; the
coordinator aborted); ``ProgressWatch`` ends a job whose ranks are alive but stuck;
``summarise`` reads the run's events into the one block the launcher prints at the end
(which rank failed, how, when; what to do next).
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from resihp.trainer_hooks.reporting.notices import PEER_FAILURE_EXIT_CODE


class JobFinishedWatch:
    """Follows the coordinator's event log for ``job-finished`` (every rank said goodbye).

    With ULFM's detector thread, Open MPI can hang in finalisation *inside* the rank
    processes, so "no rank process left" never comes; a clean goodbye from every rank is
    the other signal that the job is over.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.finished = False
        self.aborted = False
        self.mismatch = ""  # the coordinator's layout-mismatch, once said

    def poll(self) -> bool:
        if self.finished:
            return True
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return False
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.finished = b'"event": "job-finished"' in complete or b'"event":"job-finished"' in complete
        # the coordinator gave up (no layout can run, repeated failed reconfigurations): the
        # ranks may be stuck in a broken world, so the job is over too
        self.aborted = self.aborted or b'"to":"ABORTED"' in complete or b'"to": "ABORTED"' in complete
        if b"layout-mismatch" in complete and not self.mismatch:
            # the ranks run another layout than the coordinator was given: the user must hear it
            for line in complete.splitlines():
                if b"layout-mismatch" in line:
                    try:
                        self.mismatch = str(json.loads(line).get("reason", ""))
                    except json.JSONDecodeError:
                        continue
                    print(f"resihp launch: {self.mismatch}", file=sys.stderr, flush=True)
                    break
        return self.finished or self.aborted


class ProgressWatch:
    """Whether the job still makes progress: some file the job writes as it trains grew.

    The coordinator writes every reported iteration to ``trace.jsonl`` (within a second),
    the loss rank writes ``progress.jsonl``, and every command, ack and finding goes to
    ``events.jsonl``. When none of them grew for ``timeout_s`` the ranks are stuck (for
    example alive but hung, which MPI does not detect without ULFM's detector thread), and a
    job that never ends is worse than one that stops with a reason. ``clock``: injected for
    tests."""

    NAMES = ("trace.jsonl", "progress.jsonl", "events.jsonl")
    ASK_EVERY_S = 5.0  # how often ``ask`` is consulted while no file grows

    def __init__(self, run: Path, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 ask: Callable[[], object] | None = None) -> None:
        """``ask``: a second witness, consulted only while no file grows (the coordinator's latest
        iteration): a run directory that stopped taking writes (disk full, read-only) does not
        make a training job look stuck."""
        self.run = run
        self.timeout_s = timeout_s
        self.clock = clock
        self.ask = ask
        self._sizes: tuple[int, ...] = self._measure()
        self._since = clock()
        self._answer: object = None
        self._asked = clock()

    def _measure(self) -> tuple[int, ...]:
        out = []
        for name in self.NAMES:
            try:
                out.append((self.run / name).stat().st_size)
            except OSError:
                out.append(-1)
        return tuple(out)

    def stalled_s(self) -> float | None:
        """Seconds without progress once past ``timeout_s`` (else None; never with timeout 0)."""
        now, sizes = self.clock(), self._measure()
        if sizes != self._sizes:
            self._sizes, self._since = sizes, now
        elif self.ask is not None and now - self._asked >= self.ASK_EVERY_S:
            self._asked = now
            answer = self.ask()
            if answer is not None and answer != self._answer:
                self._answer, self._since = answer, now
        if self.timeout_s <= 0 or now - self._since < self.timeout_s:
            return None
        return now - self._since


DRAIN_REASON = "drained by the operator"  # coordinator/service/admin.py's ABORTED reason for a drain
RESTART_ENV = "RESIHP_RESTART_CMD"  # the launch's own command line, shell-quoted, for the ranks to print


def _read_events(path: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written
        if isinstance(obj, dict):
            out.append(obj)  # pyright: ignore[reportUnknownArgumentType]
    return out


def _clock(t: object) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t))) if isinstance(t, (int, float)) else "?"


def summarise(run: Path, mpirun_rc: int, *, stalled_s: float | None = None, interrupted: bool = False,
              finished: bool = False, restart_cmd: str = "") -> tuple[int, str]:
    """The launcher's exit status and its closing block. Non-zero whenever a rank failed
    (a fail-stop: non-zero exit, signal, silence), the coordinator aborted, the job stalled
    or mpirun failed without every rank having said goodbye — unless the job survived its
    failures: it finished (every rank left or was declared dead) and surviving ranks trained
    on past the last failure and said goodbye (a resilient job's recovery), which is
    reported, with status 0."""
    events = _read_events(run / "events.jsonl")
    failures: list[str] = []
    seen: set[int] = set()
    last_failure = -1
    left_on_notice: list[int] = []  # survivors that ended themselves on a peer-failure notice
    for i, ev in enumerate(events):
        if ev.get("event") == "finding" and ev.get("kind") == "fail-stop":
            last_failure = i
            ranks = ev.get("ranks")
            for r in ranks if isinstance(ranks, list) else []:  # pyright: ignore[reportUnknownVariableType]
                if isinstance(r, int) and r not in seen:
                    seen.add(r)
                    if failures and f"exited with code {PEER_FAILURE_EXIT_CODE} " in str(ev.get("reason", "")):
                        left_on_notice.append(r)
                        continue
                    failures.append(f"rank {r}: {ev.get('reason', 'failed')} (at {_clock(ev.get('time'))}, "
                                    f"iteration {ev.get('iteration', '?')})")
    # an operator's drain ends the job on purpose (ABORTED too, by its reason): not a failure
    aborted = [ev for ev in events if ev.get("event") == "state" and ev.get("to") == "ABORTED"
               and not str(ev.get("reason", "")).startswith(DRAIN_REASON)]
    survived = bool(failures) and finished and not aborted and stalled_s is None and not interrupted and any(
        ev.get("event") == "rank-finished" for ev in events[last_failure + 1:])
    if survived:
        return 0, "\n".join([f"resihp launch: job finished; it survived {len(failures)} failed rank(s):",
                              *(f"  {line}" for line in failures), f"  logs: {run} (events.jsonl)"])
    lines: list[str] = list(failures)
    if left_on_notice and not survived:
        lines.append(f"ranks {', '.join(map(str, left_on_notice))}: told of the failure, left at once "
                     f"(exit {PEER_FAILURE_EXIT_CODE}) instead of waiting in a collective")
    for ev in aborted[:1]:
        lines.append(f"the coordinator aborted the job at {_clock(ev.get('time'))}: {ev.get('reason', '')}")
    if stalled_s is not None:
        lines.append(f"no progress for {stalled_s:.0f} s: the ranks were stuck and the job was ended")
    rc = 0
    if interrupted:
        rc = 130
        lines.append("interrupted (Ctrl-C / SIGTERM); the job was stopped")
    elif lines:
        rc = 1
    elif mpirun_rc != 0 and not finished:
        rc = mpirun_rc if 0 < mpirun_rc < 256 else 1
        lines.append(f"mpirun exited with status {mpirun_rc} before every rank said goodbye "
                     f"(a rank failed before it reached resihp's init?); see its output above")
    if rc == 0:
        return 0, f"resihp launch: job finished; every rank left cleanly (run dir {run})"
    block = [f"resihp launch: job FAILED (exit status {rc})", *(f"  {line}" for line in lines),
             f"  logs: {run} (events.jsonl, coordinator.log, agent-*.log)"]
    if restart_cmd:
        block += ["  what to do: fix the cause, then restart from the last checkpoint with:", f"    {restart_cmd}"]
    return rc, "\n".join(block)
