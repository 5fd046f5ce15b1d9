"""Deaths the coordinator announced, heard on the hook's command thread while the main thread
may be blocked waiting for a peer in a switch's rendezvous (trainer_hooks/reconfig/live.py).

A fail-stop plan names the dead in its reason (``fail-stop of ranks [6, 7]; …``, the prefix
the coordinator gives every plan that replaces dead ranks; a rank merely left out, e.g.
excluded by the operator, is alive). A rank waiting for peers of an older epoch that such a
plan names dead stops waiting at once instead of at its timeout. Pure Python, thread-safe.
"""
from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from resihp.coordinator.protocol import messages as m


class PeerDeclaredDead(RuntimeError):
    """A peer this rank waits for was declared dead by the coordinator (a peer failure)."""


class PeerDeathListener(ABC):
    """What ``DeathNotices.on_peer_death`` calls (a class, so that it can be held weakly)."""

    @abstractmethod
    def __call__(self, cmd: m.ReconfigCommand, dead: frozenset[int]) -> None: ...


class DeathNotices:
    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # notified on every fail-stop plan noted
        self._dead: list[tuple[int, frozenset[int]]] = []  # (epoch, ranks named dead) of fail-stop plans
        self._keep = keep
        self._own: tuple[int, Callable[[m.ReconfigCommand], None]] | None = None
        # bumped on every fail-stop plan noted: a step reads it between its ops (one attribute
        # read) and takes the lock only when it moved
        self.version = 0
        # called on the command thread with (the plan's command, ranks named dead) for every fail-stop plan;
        # held weakly: a listener lives as long as the runtime that made it
        self._listeners: weakref.WeakSet[PeerDeathListener] = weakref.WeakSet()

    def on_peer_death(self, listener: PeerDeathListener) -> None:
        """Call ``listener(cmd, dead)`` on the command thread for every fail-stop plan noted from
        now on, while something else holds ``listener``. It must return soon: the thread it
        runs on carries the coordinator's commands."""
        with self._lock:
            self._listeners.add(listener)

    def on_own_death(self, rank: int, callback: Callable[[m.ReconfigCommand], None]) -> None:
        """Call ``callback`` (on the command thread) when a fail-stop plan names ``rank`` dead: this
        process was declared dead — e.g. it was stopped long enough for the job to go on without
        it and woke up — whatever its main thread is blocked in."""
        self._own = (rank, callback)

    def note(self, cmd: m.Command) -> None:
        if not isinstance(cmd, m.ReconfigCommand):
            return
        dead = frozenset(m.failed_ranks(cmd.reason))
        if not dead:
            return
        with self._lock:
            self._dead.append((cmd.epoch, dead))
            del self._dead[:-self._keep]
            own = self._own
            self.version += 1
            self._news.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener(cmd, dead)
        if own is not None and own[0] in dead:
            own[1](cmd)

    def dead_among(self, waited_for: Iterable[int], epoch: int) -> list[int]:
        """The ranks of ``waited_for`` that a fail-stop plan newer than ``epoch`` names dead."""
        ranks = set(waited_for)
        with self._lock:
            gone = {r for e, dead in self._dead if e > epoch for r in ranks & dead}
        return sorted(gone)

    def wait(self, timeout_s: float, since: int) -> int:
        """Sleep up to ``timeout_s`` unless a fail-stop plan is (or was, after version ``since``)
        noted; returns the version. A poll loop (an idle spare, the survivor awaiting the
        coordinator's plan) wakes on the news instead of at its next tick."""
        with self._news:
            if self.version == since:
                self._news.wait(timeout_s)
            return self.version

    def clear(self) -> None:
        with self._lock:
            self._dead.clear()
            self._own = None
            self._listeners = weakref.WeakSet()


DEATHS = DeathNotices()  # one per process: the hook client notes, the switch reads


class DeathWatch:
    """A training step's look at the notices between its ops: a member of its plan that a
    newer fail-stop plan names dead ends the step with ``PeerDeclaredDead``, so a rank busy
    computing enters the recovery when the coordinator's word arrives, not when its next
    collective with the dead (or with a peer that already gave up) fails — on NCCL a
    collective with a dead peer may never fail at all. Costs one attribute read per op."""

    def __init__(self, rank: int, members: Iterable[int], epoch: int, deaths: DeathNotices = DEATHS) -> None:
        self.rank = rank
        self.members = frozenset(members)
        self.epoch = epoch
        self.deaths = deaths
        self._seen = deaths.version

    def __call__(self) -> None:
        if self.deaths.version == self._seen:
            return
        self._seen = self.deaths.version
        dead = self.deaths.dead_among(self.members, self.epoch)
        if dead:
            raise PeerDeclaredDead(f"rank {self.rank}: the coordinator declared ranks {dead} of epoch {self.epoch} "
                                   "dead during this step")
