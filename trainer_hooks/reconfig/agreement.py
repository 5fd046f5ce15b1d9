"""Every member switches at the same step boundary, whenever each one received the command.

The coordinator picks a command's ``apply_at`` from reports that lag the ranks (the hooks
flush every 0.25 s, a loaded machine delays more). A command that reaches one rank before
its ``apply_at`` and another only after it would make the first switch while the second
runs the step: each then waits on the other until gloo times out, and the job takes a
healthy world for a failed one. Holding the command back by a margin makes that unlikely;
this module makes it impossible.

At every boundary ``b`` (after step ``b``) each member posts what it *holds* — the newest
planned epoch among its pending commands, and whether it holds a job-wide drain — to the
job's store, on a background thread, and reads every member's post of ``b - 1``, which is
there by then (finishing step ``b`` needs every member to have started it, so to have
posted ``b - 1``). All members read the same posts and take the same decision: a command
applies at the first boundary at or after its ``apply_at`` at which every member is known
to hold it. A command that arrives two boundaries ahead (the coordinator's margin) applies
exactly at ``apply_at``; a late one applies a boundary or two later, on every rank alike.

After a switch or a recovery the members start over (nothing outstanding, a fresh key
prefix per epoch), so a rank that joined — a readmitted spare — is in step at once.
Costs per boundary: four store operations on the background thread; the loop only hands
over a tuple and reads a result that is (almost always) ready.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from resihp.coordinator.protocol import messages as m

log = logging.getLogger(__name__)
PREFIX = "resihp/agree"
ABANDONED = "abandoned"  # what a closing member writes in place of posts that will never come


class AgreementTimeout(RuntimeError):
    """Members did not post a boundary in time ("Timed out": classified as a peer failure)."""


@dataclass(frozen=True)
class Holding:
    """What one member holds at a boundary (and, as the minimum over members, what all hold)."""

    epoch: int  # the newest planned-reconfiguration epoch pending here (the current epoch if none)
    drain: bool  # a job-wide DrainCommand is pending here

    def encode(self) -> bytes:
        return f"{self.epoch},{int(self.drain)}".encode()

    @staticmethod
    def decode(raw: bytes, key: str) -> Holding:
        try:
            epoch_s, drain_s = raw.decode().split(",")
            return Holding(int(epoch_s), drain_s == "1")
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"agreement: store key {key!r} holds {raw[:40]!r}, not 'EPOCH,DRAIN'; "
                             f"is another job using this store?") from None


def is_agreed_command(cmd: m.Command) -> bool:
    """Commands every member must apply at the same boundary: planned reconfigurations and
    job-wide drains (a fail-stop plan goes through the recovery; throttles are per rank)."""
    if isinstance(cmd, m.ReconfigCommand):
        return not cmd.reason.startswith("fail-stop")
    return isinstance(cmd, m.DrainCommand) and not cmd.ranks


def holding_of(pending: Iterable[m.Command], current_epoch: int, rank: int) -> Holding:
    epoch, drain = current_epoch, False
    for cmd in pending:
        if not is_agreed_command(cmd) or not m.command_targets(cmd, rank):
            continue
        if isinstance(cmd, m.ReconfigCommand):
            epoch = max(epoch, cmd.epoch)
        else:
            drain = True
    return Holding(epoch, drain)


def common(posts: Sequence[Holding]) -> Holding:
    """What every member holds: commands arrive at every rank in the coordinator's order, so
    a member that holds epoch E holds every planned epoch before it too."""
    return Holding(min(p.epoch for p in posts), all(p.drain for p in posts))


def is_due(cmd: m.Command, next_it: int, agreed: Holding | None) -> bool:
    """Whether an agreed command applies before step ``next_it``: its apply_at has come and
    every member is known to hold it (never at a boundary with no agreement)."""
    if agreed is None or cmd.apply_at > next_it:
        return False
    if isinstance(cmd, m.ReconfigCommand):
        return cmd.epoch <= agreed.epoch
    return agreed.drain


def round_key(epoch: int, boundary: int, rank: int) -> str:
    return f"{PREFIX}/e{epoch}/b{boundary}/r{rank}"


class BoundaryAgreement:
    """One member's side of the agreement. ``connect``: makes a client of the job's store (called
    on the worker thread, so a slow connect never holds up the loop)."""

    def __init__(self, connect: Callable[[], Any], rank: int, timeout_s: float) -> None:
        self.connect = connect
        self.rank = rank
        self.timeout_s = timeout_s
        self._round: tuple[int, int, Future[Holding]] | None = None  # (epoch, boundary, result)
        self._worker: _Worker | None = None
        self._abandoned: list[_Worker] = []  # stopped, perhaps still waiting on the store
        self._outstanding: list[tuple[list[str], Future[Holding]]] = []  # rounds posted, not yet complete

    def post(self, epoch: int, boundary: int, members: Sequence[int], holding: Holding) -> None:
        """Post this member's holding at ``boundary`` and start reading every member's."""
        if self._worker is None:
            self._worker = _Worker(self.connect)
        keys = [round_key(epoch, boundary, r) for r in members]
        own = round_key(epoch, boundary, self.rank)
        stale = round_key(epoch, boundary - 2, self.rank)  # every member has read it (see module doc)
        fut: Future[Holding] = Future()
        self._worker.submit(lambda store: _run_round(store, own, holding, stale, keys, self.timeout_s), fut)
        self._round = (epoch, boundary, fut)
        self._outstanding = [o for o in self._outstanding if not o[1].done()] + [(keys, fut)]

    def collect(self, give_up: Callable[[], bool] = lambda: False, slice_s: float = 0.2) -> Holding | None:
        """What every member held at the last posted boundary (None when none is outstanding, or
        when ``give_up`` says to stop waiting, e.g. the coordinator reported a death). Raises
        AgreementTimeout when members stay silent past ``timeout_s``."""
        if self._round is None:
            return None
        epoch, boundary, fut = self._round
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                got = fut.result(timeout=slice_s)
                self._round = None
                return got
            except TimeoutError:
                if give_up():
                    self.reset()
                    return None
                if time.monotonic() > deadline:
                    self.reset()
                    raise AgreementTimeout(
                        f"agreement: Timed out after {self.timeout_s:.0f} s waiting for the members' posts of boundary "
                        f"{boundary} (epoch {epoch}); a member stopped without the job seeing it fail") from None
            except Exception:
                self._round = None
                self.reset()
                raise

    def reset(self) -> None:
        """Forget the outstanding round (after a switch, a rollback or a failure). A worker still
        blocked on the store is abandoned; the next post starts a fresh one."""
        if self._round is not None and not self._round[2].done() and self._worker is not None:
            self._worker.stop()
            self._abandoned = [w for w in self._abandoned if w.alive()] + [self._worker]
            self._worker = None
        self._round = None

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the workers and let none stay in a store call: a daemon thread woken inside torch
        while the interpreter exits aborts the process ("terminate called without an active
        exception"). A round still waiting — abandoned after a switch, or the last one, whose
        posts some member never made — is released by writing ``ABANDONED`` in place of the
        missing posts (``compare_set``: a member's real post is never overwritten; nobody reads
        these rounds any more). False if a worker is still in the store after ``timeout_s``."""
        self._round = None
        workers = [*self._abandoned, *([self._worker] if self._worker is not None else [])]
        self._abandoned, self._worker = [], None
        for w in workers:
            w.stop()
        waiting = [keys for keys, fut in self._outstanding if not fut.done()]
        self._outstanding = []
        if waiting:
            try:
                store = self.connect()
                for keys in waiting:
                    for key in keys:
                        store.compare_set(key, "", ABANDONED)
            except Exception as exc:  # noqa: BLE001 - the store is gone: nothing waits on it either
                log.warning("agreement: could not release %d waiting round(s): %s", len(waiting), exc)
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        left = sum(w.alive() for w in workers)
        if left:
            log.warning("agreement: %d worker(s) still in a store call after %.1f s", left, timeout_s)
        return not left


def _run_round(store: Any, own: str, holding: Holding, stale: str, keys: list[str], timeout_s: float) -> Holding:
    store.set(own, holding.encode())
    try:
        store.delete_key(stale)
    except Exception:  # noqa: BLE001 - a key that was never written (the first rounds) is fine
        pass
    try:  # twice the loop's deadline: the loop's own timeout, with its clearer message, comes first
        store.wait(keys, timedelta(seconds=2.0 * timeout_s))
    except Exception as exc:  # noqa: BLE001 - the store's wait timeout: say so in our words
        raise AgreementTimeout(f"agreement: Timed out waiting for {len(keys)} members' posts: {exc}") from exc
    return common([Holding.decode(v, k) for k, v in zip(keys, store.multi_get(keys))])


class _Worker:
    """A daemon thread with its own store client that runs rounds in order (daemon: an abandoned
    round blocked on the store never holds up the process's exit)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Holding], Future[Holding]] | None] = queue.SimpleQueue()
        self._connect = connect
        self._thread = threading.Thread(target=self._run, name="resihp-agreement", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Any], Holding], fut: Future[Holding]) -> None:
        self._jobs.put((fn, fut))

    def stop(self) -> None:
        self._jobs.put(None)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        store: Any = None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                if store is None:
                    store = self._connect()
                fut.set_result(fn(store))
            except Exception as exc:  # noqa: BLE001 - handed to the loop, which decides
                fut.set_exception(exc)
