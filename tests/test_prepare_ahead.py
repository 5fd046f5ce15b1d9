"""A fail-stop plan heard on the command thread starts the recovery's reshard preparation
ahead (trainer_hooks/runtime/recovery.PrepareAhead): which notices start it, for which
survivors, and that a failure there is left to the recovery. The reconfigurer is a stand-in
recording its ``prepare`` calls (pure rule); a real recovery's log shows the prepared phase
at 0 ms (tests/test_launch.py)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.runtime.recovery import PREPARE_AHEAD_ENV, PrepareAhead, prepare_ahead_wanted


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


def test_a_newer_fail_stop_plan_is_prepared_ahead_for_the_survivors_it_implies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREPARE_AHEAD_ENV, "on")
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


def test_a_preparation_that_fails_is_left_to_the_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREPARE_AHEAD_ENV, "on")
    DEATHS.clear()
    rc = Reconfigurer(fail=True)
    ahead = PrepareAhead(rc)  # type: ignore[arg-type]
    DEATHS.note(_fail_stop(4, [5]))
    assert rc.done.wait(30) and ahead.started == [4]  # the thread logged it and ended; nothing raised here


def test_off_and_auto_on_an_oversubscribed_host_prepare_nothing_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREPARE_AHEAD_ENV, "off")
    DEATHS.clear()
    rc = Reconfigurer()
    ahead = PrepareAhead(rc)  # type: ignore[arg-type]
    DEATHS.note(_fail_stop(4, [5]))
    assert ahead.started == [] and rc.calls == []
    import os

    cores = len(os.sched_getaffinity(0))
    assert prepare_ahead_wanted({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores + 1)}) is False  # auto: a core short
    assert prepare_ahead_wanted({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores)}) is True
    assert prepare_ahead_wanted({PREPARE_AHEAD_ENV: "on", "LOCAL_WORLD_SIZE": str(cores * 4)}) is True


def test_an_unknown_prepare_ahead_value_is_named_and_taken_as_auto(caplog: pytest.LogCaptureFixture) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level("WARNING"):
        assert prepare_ahead_wanted({PREPARE_AHEAD_ENV: "sometimes", "LOCAL_WORLD_SIZE": str(cores + 1)}) is False
    assert "RESIHP_PREPARE_AHEAD='sometimes' is not on, off or auto: taken as auto" in caplog.text
