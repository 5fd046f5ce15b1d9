"""Fence orders nobody can carry out: a rank declared dead on a node whose agent is gone for good.

The coordinator orders a fence through the dead rank's node agent; an order whose agent is
gone waits for the agent's restart (coordinator/service/fencing.py) and says so in the event
log (``fence`` with ``sent: false``). If the agent's restart budget is spent, nothing would
ever carry the order out, and a stopped rank would hold its survivors in MPI's shrink for
good. Whoever supervised that agent — the launcher for the nodes it simulates, a node's own
supervisor (launch/node_supervisor.py) on a machine of a ``--hostfile`` job — reads the
orders from the event log and fences the pid itself, under the same check as the agent's (the
process must belong to this job), and records a ``fence-result`` of its own.

The log is read as it grows, whole lines only; an order sent to an agent after all (``fence``
with ``sent: true``) or carried out (``fence-result`` ok) is no longer pending.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from resihp.agent.fence_pid import is_job_process, sigkill
from resihp.trainer_hooks.launch.supervise import append_event


@dataclass(frozen=True)
class PendingFence:
    rank: int
    node: str
    pid: int


class OrphanFences:
    """The event log's fence orders that wait for an agent, and their fencing where that agent
    will not come back. ``kill`` and ``owned`` are injectable (tests)."""

    def __init__(self, events_path: Path, job: str, source: str,
                 kill: Callable[[int, str], tuple[bool, str]] = sigkill,
                 owned: Callable[[int, str], bool] = is_job_process) -> None:
        self.events_path = events_path
        self.job = job
        self.source = source  # who fences, for the event log: "launcher", "node-supervisor on NODE"
        self._kill = kill
        self._owned = owned
        self._offset = 0
        self._partial = b""
        self.pending: dict[int, PendingFence] = {}

    def read(self) -> None:
        """Take in the log's new whole lines."""
        try:
            with open(self.events_path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except OSError:  # not there (yet), or unreadable: nothing new
            return
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for raw in lines:
            try:
                event = json.loads(raw)
            except ValueError:
                continue  # a line the log lost half of (a full disk): not an order
            if isinstance(event, dict):
                self._take(event)

    def _take(self, event: dict[str, object]) -> None:
        kind, rank = event.get("event"), event.get("rank")
        if not isinstance(rank, int):
            return
        if kind == "fence" and event.get("sent") is False:
            pid = event.get("pid")
            if isinstance(pid, int) and pid > 0:
                self.pending[rank] = PendingFence(rank, str(event.get("node") or ""), pid)
        elif (kind == "fence" and event.get("sent") is True) or (kind == "fence-result" and event.get("ok") is True):
            self.pending.pop(rank, None)

    def poll(self, agentless: Collection[str]) -> list[str]:
        """Fence every pending order on a node of ``agentless`` (nodes whose agent will not be
        restarted); a line per fence, as recorded in the event log."""
        self.read()
        lines = []
        for order in sorted(self.pending.values(), key=lambda o: o.rank):
            if order.node not in agentless:
                continue
            del self.pending[order.rank]
            if self._owned(order.pid, self.job):
                ok, detail = self._kill(order.pid, order.node)
            else:
                ok, detail = True, f"pid {order.pid} is no longer a process of job {self.job}"
            reason = f"rank {order.rank}: its agent on {order.node} is gone for good; {self.source} fenced it: {detail}"
            append_event(self.events_path, {"rank": order.rank, "ok": ok, "node": order.node, "reason": reason,
                                            "time": round(time.time(), 6), "job": self.job, "event": "fence-result",
                                            "source": self.source})
            lines.append(reason)
        return lines
