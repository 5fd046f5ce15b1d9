"""Durable coordinator state: the journal (epochs, plans, commands, state) and the event log.

Both are JSON Lines files in the run directory, append-only, one object per line with a
``format`` of 1 in their first line. A restarted coordinator replays the journal to resume
at the same epoch, command sequence, plan, exclusions and policy; the event log is
re-read so event numbers keep increasing. Writes that a restart depends on (plans and
commands) are fsynced. A torn last line (a crash mid-write) is skipped with a warning.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass
class JournalState:
    job: str = ""
    t0: float = 0.0
    epoch: int = 0
    seq: int = 0
    plan: Plan | None = None
    state: str = "RUNNING"
    state_reason: str = ""
    excluded: set[int] = field(default_factory=set)
    policy: dict[str, str] = field(default_factory=dict)
    # plan-audit regrets still in force (coordinator/service_audit.Regret.to_json), by id
    regrets: dict[int, dict[str, Any]] = field(default_factory=dict)
    last_iteration: int = -1
    pending_seq: int = 0  # a command still waiting for acks when the coordinator stopped
    dead: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (pid, why); a new pid clears it
    finished: set[int] = field(default_factory=set)
    restarts: int = 0


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    with path.open(encoding="utf-8") as fh:
        for n, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                log.warning("%s line %d is not valid JSON (torn write?); skipped", path, n)
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


class Journal:
    """Append-only record of what a restarted coordinator needs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.unwritten = 0  # entries the file could not take (disk full, read-only)
        self._fh = path.open("a", encoding="utf-8")
        if path.stat().st_size == 0:
            self._write({"type": "format", "format": FORMAT}, sync=True)

    def resuming(self) -> bool:
        """A job started on this journal before: a coordinator built on it resumes."""
        return self.load().t0 > 0

    def load(self) -> JournalState:
        st = JournalState()
        for obj in _read_lines(self.path):
            kind = obj.get("type")
            try:
                if kind == "start":
                    if not st.t0:
                        st.job, st.t0 = str(obj["job"]), float(obj["t0"])
                    else:
                        st.restarts += 1
                elif kind == "plan":
                    st.plan = Plan.from_dict(obj["plan"])
                    st.epoch = max(st.epoch, int(obj["epoch"]))
                elif kind == "command":
                    st.seq = max(st.seq, int(obj["seq"]))
                    st.epoch = max(st.epoch, int(obj["epoch"]))
                    st.pending_seq = int(obj["seq"]) if obj.get("await_acks") else st.pending_seq
                elif kind == "acked":
                    if int(obj["seq"]) == st.pending_seq:
                        st.pending_seq = 0
                elif kind == "state":
                    st.state, st.state_reason = str(obj["state"]), str(obj.get("reason", ""))
                elif kind == "exclude":
                    st.excluded.add(int(obj["rank"]))
                elif kind == "readmit":
                    st.excluded.discard(int(obj["rank"]))
                elif kind == "policy":
                    st.policy.update({str(k): str(v) for k, v in obj["policy"].items()})
                elif kind == "regret":
                    st.regrets[int(obj["regret"]["id"])] = dict(obj["regret"])
                elif kind == "regret-over":
                    st.regrets.pop(int(obj["id"]), None)
                elif kind == "rank":
                    rank = int(obj["rank"])
                    if obj["state"] == "dead":
                        st.dead[rank] = (int(obj.get("pid", 0)), str(obj.get("reason", "")))
                    elif obj["state"] == "finished":
                        st.finished.add(rank)
                    else:  # back: a new process for that rank
                        st.dead.pop(rank, None)
                        st.finished.discard(rank)
                elif kind == "iteration":
                    st.last_iteration = max(st.last_iteration, int(obj["iteration"]))
            except (KeyError, TypeError, ValueError, SpecError) as exc:
                log.warning("journal %s: skipping malformed %s entry: %s", self.path, kind, exc)
        return st

    def _write(self, obj: dict[str, Any], sync: bool = False) -> None:
        with self._lock:
            try:
                self._fh.write(json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n")
                self._fh.flush()
                if sync:
                    os.fsync(self._fh.fileno())
            except OSError as exc:  # disk full or read-only: the job goes on; a restart could not resume
                self.unwritten += 1
                if self.unwritten == 1:
                    log.error("journal %s cannot be written (%s): the coordinator goes on, but a restarted one "
                              "could not resume from this journal", self.path, exc)

    def start(self, job: str, t0: float) -> None:
        self._write({"type": "start", "job": job, "t0": t0}, sync=True)

    def plan(self, plan: Plan) -> None:
        self._write({"type": "plan", "epoch": plan.epoch, "plan": plan.to_dict()}, sync=True)

    def command(self, body: dict[str, Any], await_acks: bool) -> None:
        """A command as issued (``body`` holds seq, epoch, kind, apply_at, ... and the plan)."""
        self._write({"type": "command", "seq": body["seq"], "epoch": body["epoch"], "await_acks": await_acks,
                     "command": body}, sync=True)

    def last_command(self) -> dict[str, Any] | None:
        cmds = [o for o in _read_lines(self.path) if o.get("type") == "command"]
        body = cmds[-1].get("command") if cmds else None
        return body if isinstance(body, dict) else None

    def acked(self, seq: int) -> None:
        self._write({"type": "acked", "seq": seq}, sync=True)

    def state(self, state: str, reason: str) -> None:
        self._write({"type": "state", "state": state, "reason": reason})

    def exclusion(self, rank: int, excluded: bool) -> None:
        self._write({"type": "exclude" if excluded else "readmit", "rank": rank}, sync=True)

    def regret(self, regret: dict[str, Any]) -> None:
        """A switch the plan audit undid (it keeps the layout for its fault)."""
        self._write({"type": "regret", "regret": regret}, sync=True)

    def regret_over(self, regret_id: int) -> None:
        """A regret no longer holds (its fault is over, or the operator overruled it)."""
        self._write({"type": "regret-over", "id": regret_id}, sync=True)

    def policy(self, policy: dict[str, str]) -> None:
        self._write({"type": "policy", "policy": policy}, sync=True)

    def rank_state(self, rank: int, state: str, reason: str = "", pid: int = 0) -> None:
        """A rank died, finished cleanly, or came back (state "alive")."""
        self._write({"type": "rank", "rank": rank, "state": state, "reason": reason, "pid": pid}, sync=True)

    def iteration(self, iteration: int) -> None:
        self._write({"type": "iteration", "iteration": iteration})

    def close(self) -> None:
        with self._lock:
            self._fh.close()


class EventLog:
    """The structured event log (JSON Lines) plus an in-memory window for ``admin events``."""

    def __init__(self, path: Path, job: str, clock: Callable[[], float], window: int = 10000) -> None:
        self.path = path
        self.job = job
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        self._recent: deque[dict[str, Any]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.seq = 0
        for obj in _read_lines(path):
            if isinstance(obj.get("seq"), int):
                self.seq = max(self.seq, obj["seq"])
                self._recent.append(obj)
        self._fh = path.open("a", encoding="utf-8")
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.unwritten = 0  # events the file could not take (disk full, read-only)

    def emit(self, event_type: str, /, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self.seq += 1
            event = {**fields, "seq": self.seq, "time": round(self.clock(), 6), "job": self.job, "event": event_type}
            try:
                self._fh.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
                self._fh.flush()
            except OSError as exc:  # still in memory for ``admin events``; the control plane goes on
                self.unwritten += 1
                if self.unwritten == 1:
                    log.error("event log %s cannot be written (%s); events stay readable with "
                              "`resihp admin events`", self.path, exc)
            self._recent.append(event)
        log.info("event %s: %s", event_type, fields.get("reason", "") or fields)
        for listener in self.listeners:
            listener(event)
        return event

    def since(self, after_seq: int, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._recent if e["seq"] > after_seq][:limit]

    def close(self) -> None:
        with self._lock:
            self._fh.close()
