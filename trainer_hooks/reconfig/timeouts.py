"""The groups' failure timeout: lengthened after a wait that every peer survived, restored
once the steps are short again.

A resilient job's groups time out after ``failure_timeout_s`` (6 s by default), so that a
silent peer is a failed one within seconds. A *slow* peer can outlast it: every rank then
recovers, nobody is lost, and the step redone with the same timeout would time out again for
ever. So such a recovery doubles the timeout (``lengthen_timeouts``, up to ``MAX_TIMEOUT_S``)
while the coordinator finds the slow rank and re-plans around it. Left lengthened, a later
hang (a peer alive but stuck in a collective) would hold every survivor for the longer
timeout: up to 10 minutes after a few such recoveries. ``TimeoutRestore`` gives the timeout
back once ``RESTORE_AFTER_STEPS`` steps in a row each took under half the original timeout
(no wait inside them can have come near it), and ``restore_timeouts`` applies it to the
groups in use, not only to the next ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed.distributed_c10d as c10d

from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.runtime.groups import communicators

log = logging.getLogger(__name__)

# the longest the groups' timeout grows to after waits that every peer survived (torch's NCCL
# default): a failure beyond it is still found, by the coordinator's notice if nothing sooner
MAX_TIMEOUT_S = 600.0
# short steps in a row after which a lengthened timeout goes back: a slow rank the re-plan
# kept shows in every step, a transient one is over
RESTORE_AFTER_STEPS = 8


def lengthen_timeouts(rc: LiveReconfigurer) -> float:
    """A recovery in which nobody died: a wait of the step outlasted the groups' short failure
    timeout while every peer lived — a replica or stage slow enough that its peers wait longer
    than the timeout for it (a 3x slow rank of an 8 s iteration keeps the other replica in the
    DP all-reduce for 16 s). Redone with the same timeout, the step would time out again, for
    ever (seen: 60 recoveries of one step in 3 minutes). The next groups get twice the timeout,
    up to ``MAX_TIMEOUT_S``; the coordinator meanwhile finds the slow rank and re-plans.
    Returns the groups' new timeout."""
    before = rc.group_timeout_s if rc.group_timeout_s is not None else rc.timeout_s
    after = min(MAX_TIMEOUT_S, 2.0 * before)
    rc.group_timeout_s = after
    rc.timeout_s = max(rc.timeout_s, after)
    log.warning("rank %d: a wait outlasted the %.0f s failure timeout while every peer lived (a slow peer, not a "
                "dead one): the groups' timeout is now %.0f s", rc.rank, before, after)
    return after


@dataclass
class TimeoutRestore:
    """When a lengthened timeout may go back (pure). ``base_s``: the groups' own timeout."""

    base_s: float
    short_run: int = 0  # steps in a row shorter than half of base_s, while lengthened

    def after_step(self, step_s: float, current_s: float) -> bool:
        """Count a completed step of ``step_s`` seconds under the timeout ``current_s``; True
        when the timeout should go back to ``base_s`` now."""
        if not current_s > self.base_s:
            self.short_run = 0
            return False
        self.short_run = self.short_run + 1 if 0.0 <= step_s < self.base_s / 2.0 else 0
        if self.short_run < RESTORE_AFTER_STEPS:
            return False
        self.short_run = 0
        return True


def restore_timeouts(rc: LiveReconfigurer, timeout_s: float, group_timeout_s: float | None) -> None:
    """Give ``rc`` its original timeouts back: for the groups it makes from now on and for the
    ones its runtime holds (``groups.communicators``) and the default group."""
    was = rc.group_timeout_s
    rc.timeout_s, rc.group_timeout_s = timeout_s, group_timeout_s
    held: list[Any] = communicators(rc.runtime.groups) if rc.runtime is not None else []
    seen: set[int] = set()
    for group in held:
        if id(group) in seen:
            continue
        seen.add(id(group))
        c10d._set_pg_timeout(timedelta(seconds=group_timeout_s if group_timeout_s is not None else timeout_s), group)
    c10d._set_pg_timeout(timedelta(seconds=timeout_s))  # the default group (this epoch's world)
    log.warning("rank %d: %d steps in a row took under half the %.0f s failure timeout: the groups' timeout is "
                "%.0f s again (was %s s)", rc.rank, RESTORE_AFTER_STEPS, group_timeout_s or timeout_s,
                group_timeout_s or timeout_s, f"{was:.0f}" if was is not None else "unset")


__all__ = ["MAX_TIMEOUT_S", "RESTORE_AFTER_STEPS", "TimeoutRestore", "lengthen_timeouts", "restore_timeouts"]
