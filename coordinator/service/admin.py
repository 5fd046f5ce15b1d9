"""Operator requests on the coordinator (the Admin service's logic), kept apart from the
agent-facing core so each module stays one concept. ``AdminOps`` is mixed into
``CoordinatorCore`` holds one ``CoordinatorAdmin`` as ``core.admin``; every method takes the
core's lock.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.service.statemachine import State, Trigger

if TYPE_CHECKING:
    from resihp.coordinator.service.core import CoordinatorCore
    from resihp.coordinator.service.records import AgentConn

SERVICE_POLICY = ("auto_reconfigure", "apply_margin", "ack_timeout_s", "heartbeat_timeout_s", "plan_audit",
                  "audit_margin")
SHARED_POLICY = ("heartbeat_timeout_s",)  # the coordinator's liveness clock and the engine's
SERVICE_ONLY_POLICY = tuple(k for k in SERVICE_POLICY if k not in SHARED_POLICY)
ON_OFF_POLICY = ("auto_reconfigure", "plan_audit")


class Refused(Exception):
    """An admin request that is well-formed but cannot be done now (FAILED_PRECONDITION)."""


class CoordinatorAdmin:
    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core

    def _agent_of(self, rank: int) -> AgentConn:
        for conn in self.core.agents.values():
            if rank in conn.ranks:
                return conn
        raise Refused(f"no connected agent hosts rank {rank}; has it started and said hello to its agent?")

    def inject(self, kind: str, rank: int, factor: float) -> str:
        with self.core.lock:
            self.core._check_rank(rank, "inject.rank")
            if kind == "kill":
                conn = self._agent_of(rank)
                conn.outbox.put(m.CoordinatorBatch(kills=(m.KillOrder(rank, "operator inject kill"),)))
                self.core.events.emit("inject", kind="kill", rank=rank, node=conn.node,
                                 reason=f"SIGKILL of rank {rank} ordered on {conn.node}")
                return f"kill of rank {rank} sent to the agent on {conn.node}"
            if kind == "slow":
                if not (factor >= 1.0 and factor <= 1000.0):
                    raise ValidationError(f"inject slow: factor must be in [1, 1000] (1 clears), got {factor}")
                conn = self._agent_of(rank)
                self.core.seq += 1
                it = self.core.ranks[rank].iteration
                cmd = m.ThrottleCommand(self.core.epoch, factor, max(it + 1, 0), f"operator inject slow x{factor}",
                                        self.core.seq, (rank,), self.core.clock())
                self.core._journal_command(cmd, await_acks=False)
                conn.outbox.put(m.CoordinatorBatch(commands=(cmd,)))
                self.core.metrics.inc("resihp_commands_total", 1, {"kind": "throttle", "job": self.core.config.job})
                self.core.events.emit("inject", kind="slow", rank=rank, factor=factor, command_seq=cmd.seq, node=conn.node,
                                 reason=f"throttle x{factor} relayed to rank {rank} on {conn.node}")
                return f"throttle x{factor} sent to rank {rank} on {conn.node} (command {cmd.seq})"
            raise ValidationError(f"inject kind must be 'slow' or 'kill', got {kind!r}")

    def _reshapable(self) -> None:
        """Refuse what would reshape an observe-only job (coordinator/service/observe.py)."""
        why = self.core.observe_only()
        if why:
            raise Refused(f"observe-only job: {why}; exclude, readmit and re-plan need live reconfiguration")

    def _operator_replan(self, why: str, finding: m.FindingInfo | None = None) -> str:
        self._reshapable()
        if self.core.state not in (State.RUNNING, State.SUSPECT):
            raise Refused(f"the coordinator is {self.core.state.value} ({self.core.state_reason}); retry when it is RUNNING")
        self.core._transition(Trigger.OPERATOR, why)
        before = self.core.seq
        self.core._plan(finding, self.core.now(), operator=True)
        if self.core.seq != before:
            return f"{why}: epoch {self.core.epoch} commanded (command {self.core.seq})"
        return f"{why}: no new plan ({self.core.state_reason})"

    def exclude(self, rank: int, reason: str) -> str:
        with self.core.lock:
            self.core._check_rank(rank, "exclude.rank")
            if rank in self.core.excluded:
                raise Refused(f"rank {rank} is already excluded")
            self._reshapable()
            if self.core.state not in (State.RUNNING, State.SUSPECT):
                raise Refused(f"the coordinator is {self.core.state.value} ({self.core.state_reason}); retry when it is RUNNING")
            self.core.excluded.add(rank)
            self.core.journal.exclusion(rank, True)
            self.core._overrule_audit(rank)
            self.core.events.emit("exclude", rank=rank, reason=reason or "operator")
            return self._operator_replan(f"operator excluded rank {rank}" + (f" ({reason})" if reason else ""))

    def readmit(self, rank: int, reason: str) -> str:
        with self.core.lock:
            self.core._check_rank(rank, "readmit.rank")
            info = self.core.ranks[rank]
            # a rank the detector found slow and a re-plan left out: nothing observes it any
            # more, so only a readmission clears its verdict
            slow_spare = (not info.dead and not self.core.plan.has_rank(rank)
                          and self.core.engine.suspects().get(rank) == "slow")
            if rank not in self.core.excluded and not info.dead and not slow_spare:
                raise Refused(f"rank {rank} is neither excluded nor dead; nothing to readmit")
            if info.dead:
                raise Refused(f"rank {rank} is dead ({info.dead_reason}); it can rejoin only as a new process")
            self._reshapable()
            if self.core.state not in (State.RUNNING, State.SUSPECT):
                raise Refused(f"the coordinator is {self.core.state.value} ({self.core.state_reason}); retry when it is RUNNING")
            self.core.excluded.discard(rank)
            self.core.engine.readmit(rank)
            self.core.journal.exclusion(rank, False)
            self.core._overrule_audit(rank)
            self.core.events.emit("readmit", rank=rank, reason=reason or "operator")
            # to the planner a readmitted device is a recovered one: it may take work again
            back = m.FindingInfo(self.core.last_iteration, "recovered", (rank,), "operator", 1.0,
                                 f"operator readmitted rank {rank}", self.core.now(), **self.core._where(rank))
            return self._operator_replan(f"operator readmitted rank {rank}", back)

    def replan(self, reason: str) -> str:
        with self.core.lock:
            return self._operator_replan("operator asked for a re-plan" + (f": {reason}" if reason else ""))

    def drain(self, reason: str) -> str:
        with self.core.lock:
            if self.core.state is State.ABORTED:
                raise Refused(f"the job is already ABORTED ({self.core.state_reason})")
            self.core.seq += 1
            cmd = m.DrainCommand(self.core.epoch, self.core._apply_at(), reason or "operator drain", self.core.seq, (), self.core.clock())
            self.core._journal_command(cmd, await_acks=False)
            self.core._send_all(m.CoordinatorBatch(commands=(cmd,)))
            self.core._transition(Trigger.FATAL, f"drained by the operator at iteration {cmd.apply_at}: {cmd.reason}")
            return f"drain commanded at iteration {cmd.apply_at} (command {cmd.seq})"

    def set_policy(self, updates: Mapping[str, str]) -> dict[str, str]:
        with self.core.lock:
            if updates:
                self._apply_policy(updates, journal_it=True)
                self.core.events.emit("policy", policy=dict(updates), reason="operator changed policy")
            return {**self.core.policy, **self.core.engine.policy()}

    def _apply_policy(self, updates: Mapping[str, str], journal_it: bool) -> None:
        mine = {k: v for k, v in updates.items() if k in SERVICE_POLICY}
        theirs = {k: v for k, v in updates.items() if k not in SERVICE_POLICY or k in SHARED_POLICY}
        new = dict(self.core.policy)
        for key, value in mine.items():
            if key in ON_OFF_POLICY:
                if value not in ("on", "off"):
                    raise ValidationError(f"policy {key} must be 'on' or 'off', got {value!r}")
            else:
                from resihp.coordinator.service.engine import parse_float

                try:
                    num = parse_float(key, value, {"apply_margin": 1.0, "audit_margin": 0.0}.get(key, 0.05))
                except ValueError as exc:
                    raise ValidationError(str(exc)) from None
                value = str(int(num)) if key == "apply_margin" else str(num)
            new[key] = value
        if theirs:
            try:
                self.core.engine.set_policy(theirs)
            except ValueError as exc:
                raise ValidationError(str(exc)) from None
        self.core.policy = new
        if journal_it:
            self.core.journal.policy(dict(updates))

    def status(self) -> dict[str, Any]:
        with self.core.lock:
            now = self.core.now()
            states = self.core.engine.suspects()
            speeds = self.core.engine.rank_speed()
            probes = self.core.engine.probe_ratios()
            ranks = []
            kept = self.core.audits.verdicts()
            for r, info in sorted(self.core.ranks.items()):
                state = ("dead" if info.dead else "finished" if info.finished else "excluded" if r in self.core.excluded
                         else states.get(r, "unknown") if info.last_seen is not None else "unknown")
                ranks.append({"rank": r, "node": info.node, "state": state, "iteration": info.iteration,
                              "step_s": info.step_s, "speed": speeds.get(r, 1.0),
                              "last_seen_age_s": -1.0 if info.last_seen is None else max(0.0, now - info.last_seen),
                              "role": "member" if self.core.plan.has_rank(r) else "spare",
                              "probe_ratio": round(probes.get(r, 0.0), 4), "kept": kept.get(r, "")})
            return {"job": self.core.config.job, "state": self.core.state.value, "state_reason": self.core.state_reason,
                    "epoch": self.core.epoch, "iteration": self.core.last_iteration, "world_size": self.core.config.world_size,
                    "ranks": ranks, "agents_connected": sum(a.streaming for a in self.core.agents.values()),
                    "engine": self.core.engine.name, "policy": {**self.core.policy, **self.core.engine.policy()},
                    "uptime_s": now, "planner_profile": self.core.engine.profile_text(),
                    "observe_only": self.core.observe_only(), "model": _model_name(self.core.model_json)}


def _model_name(model_json: str) -> str:
    """The trainers' model as status shows it: its name and size ("" = none said)."""
    if not model_json:
        return ""
    import json

    try:
        d = json.loads(model_json)
        return f"{d.get('name', '?')} ({d.get('num_layers', '?')} layers, hidden {d.get('hidden', '?')})"
    except (ValueError, AttributeError):
        return "?"
