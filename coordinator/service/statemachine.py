"""The coordinator's lifecycle as an explicit state machine.

RUNNING → SUSPECT → PLANNING → RECONFIGURING → RUNNING, or ABORTED. ``step`` is pure:
it takes the current state and a trigger and returns the next state, or raises
``IllegalTransition`` naming what was tried; the caller logs one event per transition
with its reason. Pure: no grpc, deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    RUNNING = "RUNNING"
    SUSPECT = "SUSPECT"  # the detector has suspects but no confirmed finding yet
    PLANNING = "PLANNING"  # a finding (or an operator) asked for a new plan
    RECONFIGURING = "RECONFIGURING"  # a command is out; waiting for every live rank's ack
    ABORTED = "ABORTED"  # terminal: no viable plan, or drained by the operator


class Trigger(str, Enum):
    SUSPECTS = "suspects"  # detector reports suspect ranks
    CLEARED = "cleared"  # suspects went back to healthy
    FINDING = "finding"  # a confirmed fail-slow / fail-stop / recovered finding
    OPERATOR = "operator"  # exclude / readmit / replan from the admin client
    KEEP = "keep"  # the planner decided not to act
    COMMAND_SENT = "command-sent"  # the planner chose a new plan; command issued
    ACKED = "acked"  # every live rank acknowledged
    ACK_FAILED = "ack-failed"  # a rank refused or missed apply_at; plan again
    ACK_TIMEOUT = "ack-timeout"  # not every rank acknowledged in time
    UNAPPLIED = "unapplied"  # the job ended before the command's apply_at
    REGRET = "regret"  # the planner's last switch measured slower than the plan it replaced
    FATAL = "fatal"  # no viable plan / drain


TRANSITIONS: dict[tuple[State, Trigger], State] = {
    (State.RUNNING, Trigger.SUSPECTS): State.SUSPECT,
    (State.RUNNING, Trigger.FINDING): State.PLANNING,
    (State.RUNNING, Trigger.OPERATOR): State.PLANNING,
    (State.SUSPECT, Trigger.CLEARED): State.RUNNING,
    (State.SUSPECT, Trigger.FINDING): State.PLANNING,
    (State.SUSPECT, Trigger.OPERATOR): State.PLANNING,
    (State.RUNNING, Trigger.REGRET): State.PLANNING,
    (State.SUSPECT, Trigger.REGRET): State.PLANNING,
    (State.PLANNING, Trigger.KEEP): State.RUNNING,
    (State.PLANNING, Trigger.COMMAND_SENT): State.RECONFIGURING,
    (State.RECONFIGURING, Trigger.ACKED): State.RUNNING,
    (State.RECONFIGURING, Trigger.ACK_FAILED): State.PLANNING,
    # a rank the outstanding plan needs died before every ack: that plan is superseded at once
    (State.RECONFIGURING, Trigger.FINDING): State.PLANNING,
    (State.RECONFIGURING, Trigger.ACK_TIMEOUT): State.RUNNING,
    (State.RECONFIGURING, Trigger.UNAPPLIED): State.RUNNING,
}
# Any live state can be aborted.
for _s in (State.RUNNING, State.SUSPECT, State.PLANNING, State.RECONFIGURING):
    TRANSITIONS[(_s, Trigger.FATAL)] = State.ABORTED


class IllegalTransition(ValueError):
    pass


@dataclass(frozen=True)
class Transition:
    before: State
    after: State
    trigger: Trigger
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"from": self.before.value, "to": self.after.value, "trigger": self.trigger.value,
                "reason": self.reason}


def can(state: State, trigger: Trigger) -> bool:
    return (state, trigger) in TRANSITIONS


def step(state: State, trigger: Trigger, reason: str) -> Transition:
    """The transition ``trigger`` causes from ``state``; raises IllegalTransition if none."""
    try:
        after = TRANSITIONS[(state, trigger)]
    except KeyError:
        allowed = sorted(t.value for (s, t) in TRANSITIONS if s is state)
        raise IllegalTransition(
            f"no transition from {state.value} on {trigger.value!r}; allowed there: {allowed}"
        ) from None
    return Transition(state, after, trigger, reason)
