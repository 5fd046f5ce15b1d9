"""A fail-stop plan heard on the command thread starts the recovery's reshard preparation
ahead (trainer_hooks/runtime/recovery.PrepareAhead): which notices start it, for which
survivors, and that a failure there is left to the recovery. The reconfigurer is a stand-in
recording its ``prepare`` calls (pure rule); a real recovery's log shows the prepared phase
at 0 ms (tests/test_launch.py)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.runtime.recovery import PrepareAhead


@dataclass
class Reconfigurer:
    rank: int = 0
    epoch: int = 3
    members: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
    fail: bool = False
    calls: list[tuple[Plan, tuple[int, ...]]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def prepare(self, plan: Plan, alive: Any = None) -> None:
        self.calls.append((plan, tuple(alive)))
        self.done.set()
        if self.fail:
            raise RuntimeError("no survivor holds layer 3")


def _fail_stop(epoch: int, dead: list[int]) -> m.ReconfigCommand:
    return m.ReconfigCommand(epoch=epoch, plan=Plan.uniform(1, 2, 3, 4, 6), apply_at=0,
                             reason=f"fail-stop of ranks {dead}: the current plan cannot run")


def test_a_newer_fail_stop_plan_is_prepared_ahead_for_the_survivors_it_implies() -> None:
    DEATHS.clear()
    rc = Reconfigurer()
    ahead = PrepareAhead(rc)  # type: ignore[arg-type]
    DEATHS.note(_fail_stop(3, [5]))  # not newer than the rank's epoch: already behind it
    DEATHS.note(_fail_stop(4, [9]))  # no member of this world
    DEATHS.note(_fail_stop(4, [0]))  # this rank itself: it is fenced, not recovering
    assert ahead.started == [] and rc.calls == []
    cmd = _fail_stop(4, [5, 7])
    DEATHS.note(cmd)
    assert rc.done.wait(30)
    assert ahead.started == [4] and rc.calls == [(cmd.plan, (0, 1, 2, 3, 4, 6))]


def test_a_preparation_that_fails_is_left_to_the_recovery() -> None:
    DEATHS.clear()
    rc = Reconfigurer(fail=True)
    ahead = PrepareAhead(rc)  # type: ignore[arg-type]
    DEATHS.note(_fail_stop(4, [5]))
    assert rc.done.wait(30) and ahead.started == [4]  # the thread logged it and ended; nothing raised here
