"""Abort this epoch's communicators when the coordinator declares a member dead (NCCL).

On gloo a survivor blocked on a dead peer fails by itself: the peer's connections close when
its process dies (or when its groups are torn down, trainer_hooks/reconfig/failstop.py). On
NCCL a collective with a dead or hung peer is a GPU kernel that may wait for ever, and the
main thread waits with it. The coordinator's fail-stop plan reaches this process on the hook's
command thread (trainer_hooks/reporting/deaths.py) whatever the main thread is blocked in;
this listener, made by the runtime of one epoch, then aborts every communicator of that epoch
from that thread, so that the blocked operation returns with an error and the recovery starts
(the error is a peer failure: ``reconfig.ulfm.is_peer_failure``). Torch documents
``ProcessGroup.abort`` for NCCL (``_abort_process_group``); its watchdog's own abort, after
``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s timeout, comes minutes later.

Checked on a GPU by ``bench/gpu_check.sh`` (its chaos step kills a rank inside a collective
under NCCL); on the CPU the rule (which notices abort what, once) is tested with stand-ins.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reporting.deaths import DEATHS, DeathNotices, PeerDeathListener

log = logging.getLogger(__name__)


class AbortOnDeath(PeerDeathListener):
    """Aborts ``groups()`` (the epoch's communicators, read when a death is noted) once, when a
    fail-stop plan newer than ``epoch`` names one of ``members`` dead."""

    def __init__(self, rank: int, members: Iterable[int], epoch: int, groups: Callable[[], Iterable[Any]],
                 deaths: DeathNotices = DEATHS) -> None:
        self.rank = rank
        self.members = frozenset(members)
        self.epoch = epoch
        self._groups = groups
        self._lock = threading.Lock()
        self.aborted: list[str] = []  # what was aborted (for the log and tests)
        self.fired = False
        deaths.on_peer_death(self)

    def __call__(self, cmd: m.ReconfigCommand, dead: frozenset[int]) -> None:
        if cmd.epoch <= self.epoch or not dead & self.members:
            return
        with self._lock:
            if self.fired:
                return
            self.fired = True
            seen: set[int] = set()
            for group in self._groups():
                if group is None or id(group) in seen:
                    continue
                seen.add(id(group))
                try:
                    group.abort()
                    self.aborted.append(repr(group))
                except Exception as exc:  # noqa: BLE001 - one communicator that cannot abort must not stop the rest
                    log.warning("rank %d: aborting a communicator of epoch %d failed: %s", self.rank, self.epoch, exc)
        log.warning("rank %d: ranks %s of epoch %d declared dead; aborted %d communicator(s) so that no collective "
                    "waits for them", self.rank, sorted(dead & self.members), self.epoch, len(self.aborted))
