"""The launcher's supervision of the job's daemons: a dead coordinator or node agent is started
again on the same address, after a backoff, within a restart budget, and each exit and restart
is recorded in the job's event log.

The job's store is supervised the same way: restarted empty on its address, where the ranks'
clients reconnect (what was in flight fails as a peer failure, and recovery's next epoch
starts afresh). Why the same address: the ranks' hooks know their agent's hook address and the agents know the
coordinator's; a daemon that comes back where it was is found again by every client's own
reconnect loop, with no new configuration handed to anyone. A restarted coordinator resumes
from the run directory's journal (coordinator/service/journal.py); a restarted agent meets its
ranks again when their hooks reconnect and say hello.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

DEFAULT_BACKOFF_S = (0.2, 1.0, 2.0, 4.0, 8.0)


@dataclass
class Daemon:
    """One supervised process: how to start it again, and its restart history."""

    name: str  # "coordinator", "agent node0"
    argv: list[str]  # its command line, pinned to the address it first bound
    env: Mapping[str, str]
    log_path: Path
    proc: subprocess.Popen[Any]
    restart_fn: Callable[[], subprocess.Popen[Any]] | None = None  # how it starts again, if not from argv
    restarts: int = 0
    restart_at: float | None = None  # when the pending restart is due
    gave_up: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


def pin_option(argv: Sequence[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option`` set to ``value`` (replaced where present, else appended)."""
    out = list(argv)
    if option in out:
        i = out.index(option)
        if i + 1 < len(out):
            out[i + 1] = value
            return out
        del out[i]
    return out + [option, value]


class Supervisor:
    """Restarts daemons that exit while the job runs. ``poll`` is called from the launcher's
    loop (or a node's supervisor's); ``clock`` and ``start`` are injectable (tests).
    ``events_path`` None: a node that cannot see the run directory; each line is printed only."""

    def __init__(self, events_path: Path | None, job: str, budget: int = 5,
                 backoff_s: Sequence[float] = DEFAULT_BACKOFF_S, clock: Callable[[], float] = time.monotonic,
                 start: Callable[[list[str], Mapping[str, str], IO[bytes]], subprocess.Popen[bytes]] | None = None,
                 source: str = "launcher") -> None:
        if budget < 0:
            raise ValueError(f"the restart budget must be >= 0, got {budget}")
        if not backoff_s or any(b < 0 for b in backoff_s):
            raise ValueError(f"backoff must be a non-empty list of seconds >= 0, got {list(backoff_s)}")
        self.events_path = events_path
        self.job = job
        self.budget = budget
        self.backoff_s = tuple(backoff_s)
        self.clock = clock
        self._start = start or _popen
        self.daemons: list[Daemon] = []
        self.source = source

    def add(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
            proc: subprocess.Popen[Any], restart: Callable[[], subprocess.Popen[Any]] | None = None) -> Daemon:
        d = Daemon(name, list(argv), dict(env), log_path, proc, restart)
        self.daemons.append(d)
        return d

    def procs(self) -> list[subprocess.Popen[Any]]:
        return [d.proc for d in self.daemons]

    def poll(self) -> list[str]:
        """Restart what is due; returns a line per exit, restart or give-up seen this call."""
        now = self.clock()
        lines = []
        for d in self.daemons:
            if d.gave_up:
                continue
            if d.restart_at is None:
                code = d.proc.poll()
                if code is None:
                    continue
                if d.restarts >= self.budget:
                    d.gave_up = True
                    lines.append(self._record(d, "daemon-gave-up", code=code,
                                              reason=f"{d.name} exited with status {code}; its restart budget "
                                                     f"({self.budget}) is spent: the job goes on without it"))
                    continue
                wait = self.backoff_s[min(d.restarts, len(self.backoff_s) - 1)]
                d.restart_at = now + wait
                lines.append(self._record(d, "daemon-exited", code=code,
                                          reason=f"{d.name} (pid {d.proc.pid}) exited with status {code}; "
                                                 f"restart {d.restarts + 1} of {self.budget} in {wait:.1f} s"))
            if d.restart_at is not None and now >= d.restart_at:
                d.restart_at = None
                d.restarts += 1
                try:
                    if d.restart_fn is not None:
                        d.proc = d.restart_fn()
                    else:
                        with open(d.log_path, "ab") as fh:
                            d.proc = self._start(d.argv, d.env, fh)
                except (OSError, RuntimeError) as exc:  # it could not start: that spends a restart too
                    lines.append(self._record(d, "daemon-exited", code=None,
                                              reason=f"{d.name} could not be restarted: {exc}"))
                    d.restart_at = now + self.backoff_s[min(d.restarts, len(self.backoff_s) - 1)]
                    if d.restarts >= self.budget:
                        d.gave_up, d.restart_at = True, None
                    continue
                lines.append(self._record(d, "daemon-restarted", pid=d.proc.pid,
                                          reason=f"{d.name} restarted (pid {d.proc.pid}, restart {d.restarts} "
                                                 f"of {self.budget}) on its former address"))
        return lines

    def _record(self, d: Daemon, event: str, **fields: Any) -> str:
        entry = {"daemon": d.name, **fields, "time": round(time.time(), 6), "job": self.job, "event": event,
                 "source": self.source}
        d.history.append(entry)
        append_event(self.events_path, entry)
        return str(entry["reason"])


def append_event(path: Path | None, entry: Mapping[str, Any]) -> None:
    """Append ``entry`` to the job's event log as one line (None: print it). One write of one
    line to a file opened for appending: the coordinator appends its own lines to the same
    log, and O_APPEND keeps each line whole. A log that cannot be written loses the line,
    never the daemon (the run directory may have turned read-only)."""
    line = json.dumps(entry, separators=(",", ":")) + "\n"
    if path is None:
        print(line, end="", flush=True)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        print(f"resihp: event log {path} cannot be written ({exc}): {line}", end="", flush=True)


def _popen(argv: list[str], env: Mapping[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
