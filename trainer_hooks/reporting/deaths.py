"""Deaths the coordinator announced, heard on the hook's command thread while the main thread
may be blocked waiting for a peer in a switch's rendezvous (trainer_hooks/reconfig/live.py).

A fail-stop plan (its reason starts "fail-stop") names who is left: every rank of the plan and
its spares. A rank waiting for peers of an older epoch that such a plan leaves out waits for
the dead: it stops waiting at once instead of at its timeout. Pure Python, thread-safe.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from resihp.coordinator.protocol import messages as m


class PeerDeclaredDead(RuntimeError):
    """A peer this rank waits for was declared dead by the coordinator (a peer failure)."""


class DeathNotices:
    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._left: list[tuple[int, frozenset[int]]] = []  # (epoch, ranks left) of fail-stop plans
        self._keep = keep
        self._own: tuple[int, Callable[[m.ReconfigCommand], None]] | None = None

    def on_own_death(self, rank: int, callback: Callable[[m.ReconfigCommand], None]) -> None:
        """Call ``callback`` (on the command thread) when a fail-stop plan leaves ``rank`` out: this
        process was declared dead — e.g. it was stopped long enough for the job to go on without
        it and woke up — whatever its main thread is blocked in."""
        self._own = (rank, callback)

    def note(self, cmd: m.Command) -> None:
        if not isinstance(cmd, m.ReconfigCommand) or not cmd.reason.startswith("fail-stop"):
            return
        left = frozenset(cmd.plan.ranks()) | frozenset(cmd.plan.spares)
        with self._lock:
            self._left.append((cmd.epoch, left))
            del self._left[:-self._keep]
            own = self._own
        if own is not None and own[0] not in left:
            own[1](cmd)

    def dead_among(self, waited_for: Iterable[int], epoch: int) -> list[int]:
        """The ranks of ``waited_for`` that a fail-stop plan newer than ``epoch`` leaves out."""
        ranks = set(waited_for)
        with self._lock:
            gone = {r for e, left in self._left if e > epoch for r in ranks - left}
        return sorted(gone)

    def clear(self) -> None:
        with self._lock:
            self._left.clear()
            self._own = None


DEATHS = DeathNotices()  # one per process: the hook client notes, the switch reads
