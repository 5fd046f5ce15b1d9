"""The coordinator's plans and commands: ask the planner, command the new plan, wait for the
ranks' acknowledgements, audit the switch (coordinator/planner/audit.py), undo it when it
measured slower. A part of ``CoordinatorCore`` (coordinator/service/core.py), kept in its own module;
every method runs under the core's lock.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import PlanChange
from resihp.coordinator.planner.audit import AuditVerdict
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.audit import AUDITED, Audits
from resihp.coordinator.service.engine import EngineDecision, shrink_past_the_dead
from resihp.coordinator.service.records import Pending, RankInfo
from resihp.coordinator.service.statemachine import State, Trigger

if TYPE_CHECKING:
    from resihp.coordinator.service.config import CoordinatorConfig
    from resihp.coordinator.service.engine import Engine
    from resihp.coordinator.service.joiner import Joiner
    from resihp.coordinator.service.journal import EventLog, Journal
    from resihp.coordinator.service.metrics import Registry
    from resihp.coordinator.service.trace_sink import TraceSink

log = logging.getLogger(__name__)


def worth_acting(f: m.FindingInfo, degraded_only: set[int]) -> bool:
    """Whether a finding may lead to a plan, keeping ``degraded_only`` (ranks whose slow
    verdict was only ever `degraded`) up to date: a `degraded` finding costs under the impact
    floor, not worth moving state for; the recovery of such ranks changes nothing the plan
    was built around; anything else is acted on from here."""
    if f.kind == "degraded":
        degraded_only.update(f.ranks)
        return False
    was_degraded = bool(f.ranks) and set(f.ranks) <= degraded_only
    degraded_only.difference_update(f.ranks)
    return not (f.kind == "recovered" and was_degraded)
# _apply_at: a report's end time says how far the ranks got since, for up to REPORT_LAG_S (the
# hooks' 1 s flush + linger + transit; more is a stall, not lag); one older than
# MAX_EXTRAPOLATE_S (or from the future) says nothing about now
REPORT_LAG_S = 2.0
MAX_EXTRAPOLATE_S = 10.0


class PlanFlow:
    """Mixed into ``CoordinatorCore``: the methods below use its state (plan, epoch, pending,
    policy, audits, journal, events, metrics)."""

    # the core's state, set in ``CoordinatorCore.__init__``
    config: CoordinatorConfig
    clock: Callable[[], float]
    engine: Engine
    journal: Journal
    events: EventLog
    metrics: Registry
    joiner: Joiner
    trace: TraceSink | None
    plan: Plan
    epoch: int
    seq: int
    state: State
    excluded: set[int]
    ranks: dict[int, RankInfo]
    pending: Pending | None
    queued_findings: list[m.FindingInfo]
    audits: Audits
    policy: dict[str, str]
    last_iteration: int
    _progress_at: float | None

    if TYPE_CHECKING:  # the core's methods these use (coordinator/service/core.py)
        def _transition(self, trigger: Trigger, reason: str) -> bool: ...
        def _live_ranks(self) -> list[int]: ...
        def _send_all(self, batch: m.CoordinatorBatch) -> None: ...
        def _notify(self, kind: str, payload: Any) -> None: ...
        def _adopt(self, plan: Plan, first: int, now: float) -> None: ...
        def observe_only(self) -> str: ...

    def _unavailable(self) -> frozenset[int]:
        return frozenset(self.excluded | {r for r, i in self.ranks.items() if i.dead})

    def _plan(self, finding: m.FindingInfo | None, now: float, replan: bool = True, operator: bool = False) -> None:
        """Decide and command. ``replan`` False (re-planning is off, a finding outside the plan):
        keep the layout without asking the planner. ``operator``: an operator's call (its
        switch is not audited, and no earlier verdict keeps the layout against it). An
        observe-only job is never priced nor commanded (coordinator/service/observe.py)."""
        observe_only = self.observe_only()
        if observe_only:
            self._transition(Trigger.KEEP, f"observe-only: {observe_only}")
            return
        nodes = {r: i.node for r, i in self.ranks.items()}
        kept = self.audits.kept(finding) if self.policy["plan_audit"] == "on" and not operator else ""
        if not replan:
            decision = EngineDecision(False, self.plan, "re-planning is off (policy auto_reconfigure=off)")
        elif kept:
            decision = EngineDecision(False, self.plan, kept)
        else:
            try:
                decision = self.engine.decide(self.plan, finding, self._unavailable(), now, nodes)
            except Exception as exc:  # the planner failing must not take the control plane down
                log.exception("planner failed")
                self._transition(Trigger.KEEP, f"planner failed: {exc}; keeping epoch {self.epoch}")
                return
        if finding is not None and finding.kind == "fail-stop":  # acts only where the plan was kept
            dead = sorted(r for r in finding.ranks if r in self.ranks and self.ranks[r].dead)
            decision = shrink_past_the_dead(decision, self.plan, dead)
        self.events.emit("decision", epoch=self.epoch, act=decision.act, level=decision.level, reason=decision.reason)
        if decision.fatal:
            self._transition(Trigger.FATAL, decision.reason)
            return
        # a switch that measured slower is not made again while its fault lasts (whichever rank
        # the finding names: a slow link is also seen through its ring partners)
        refused = self.audits.refused(self.plan, decision.plan) if decision.act and not operator \
            and finding is not None and finding.kind in AUDITED and self.policy["plan_audit"] == "on" else ""
        if refused:
            decision = EngineDecision(False, self.plan, refused)
        if not decision.act:
            self._transition(Trigger.KEEP, decision.reason)
            self._drain_queue(now)
            return
        self._command(decision.plan, decision.reason, decision.level, now, cause=None if operator else finding)

    def _command(self, new_plan: Plan, why: str, level: str, now: float, cause: m.FindingInfo | None = None) -> None:
        """Send ``new_plan`` as the next epoch; wait for every live rank's acknowledgement. Never
        to an observe-only job: a rank there cannot apply it (coordinator/service/observe.py)."""
        observe_only = self.observe_only()
        if observe_only:
            log.error("coordinator: not commanding a new plan to an observe-only job (%s): %s", observe_only, why)
            self.events.emit("command-refused", epoch=self.epoch, kind="reconfigure",
                             reason=f"observe-only: {observe_only}; not sent: {why}")
            self._transition(Trigger.KEEP, f"observe-only: {observe_only}")
            return
        self.audits.cancel()  # a switch under audit is superseded
        self.epoch += 1
        plan = replace(new_plan, epoch=self.epoch)
        self.seq += 1
        reason = why
        lost = sorted(r for r in (*self.plan.ranks(), *self.plan.spares) if self.ranks[r].dead and not plan.has_rank(r))
        if lost and not reason.startswith(f"fail-stop of ranks {lost}"):
            # the trainers recognise a plan that replaces dead ranks by this prefix: they apply it
            # through their fail-stop recovery (shrink the world first), not as a planned switch
            reason = f"fail-stop of ranks {lost}; {reason}"
        cmd = m.ReconfigCommand(self.epoch, plan, self._apply_at(), reason, self.seq, (), self.clock())
        self.journal.plan(plan)
        self._journal_command(cmd, await_acks=True)
        self.joiner.add_plan(plan)
        if self.trace is not None:  # before any record of the new shape can be joined
            self.trace.write(PlanChange(cmd.apply_at, plan))
        self.pending = Pending(cmd, set(self._live_ranks()), now)
        if self.policy["plan_audit"] == "on":
            self.audits.start(cause, self.plan, plan, float(self.policy["audit_margin"]))
        self._transition(Trigger.COMMAND_SENT, f"epoch {self.epoch} ({level}) at iteration {cmd.apply_at}: {why}")
        self.metrics.inc("resihp_commands_total", 1, {"kind": "reconfigure", "job": self.config.job})
        self.events.emit("command", command_seq=cmd.seq, epoch=cmd.epoch, kind="reconfigure", apply_at=cmd.apply_at,
                         plan=plan.to_dict(), reason=why)
        self._send_all(m.CoordinatorBatch(commands=(cmd,)))
        self._notify("command", cmd)
        self._maybe_acked(now)

    def _overrule_audit(self, rank: int) -> None:
        for gone in self.audits.overrule(rank):
            self.journal.regret_over(gone)

    def _apply_at(self) -> int:
        """An iteration every live rank reaches only after the command has arrived: the newest
        reported one, plus the iterations run since it ended, plus a margin of iterations that
        covers ``apply_lead_s`` at the current pace.

        Reports reach the coordinator up to the hooks' flush interval (about a second) after
        their iteration ended, so the ranks are already further on: how far is extrapolated
        from the newest report's end time (its wall clock) at the fastest rank's pace. A
        report that ended in the future or long ago (clock skew, a stalled job) adds nothing."""
        live = self._live_ranks()
        newest = max([self.ranks[r].iteration for r in live] + [self.last_iteration, -1])
        steps = [self.ranks[r].step_s for r in live if self.ranks[r].step_s > 0]
        lead = math.ceil(self.config.apply_lead_s / max(steps)) if steps else 0
        ahead = 0
        ends = [self.ranks[r].iteration_end_s for r in live if self.ranks[r].iteration == newest]
        if steps and ends and max(ends) > 0:
            since = self.clock() - max(ends)
            if 0.0 < since <= MAX_EXTRAPOLATE_S:
                ahead = math.ceil(min(since, REPORT_LAG_S) / min(steps))  # rounded up: a boundary too late is safe
        return max(newest + ahead + max(int(self.policy["apply_margin"]), lead), 0)

    def _journal_command(self, cmd: m.Command, await_acks: bool) -> None:
        body: dict[str, Any] = {"seq": cmd.seq, "epoch": cmd.epoch, "kind": m.command_kind(cmd),
                                "apply_at": cmd.apply_at, "reason": cmd.reason, "ranks": list(cmd.ranks),
                                "issued_s": cmd.issued_s}
        if isinstance(cmd, m.ReconfigCommand):
            body["plan"] = cmd.plan.to_dict()
        if isinstance(cmd, m.ThrottleCommand):
            body["factor"] = cmd.factor
        self.journal.command(body, await_acks)

    def _on_ack(self, ack: m.Ack, now: float) -> None:
        self.events.emit("ack", rank=ack.rank, command_seq=ack.seq, epoch=ack.epoch, iteration=ack.iteration, ok=ack.ok,
                         reason=ack.error or "applied")
        pend = self.pending
        if pend is None or ack.seq != pend.command.seq:
            return
        if not ack.ok and ack.error.startswith(m.JOB_ENDED):  # the plan in force stays; no re-plan
            self.pending = None
            self._transition(Trigger.UNAPPLIED, f"rank {ack.rank} did not apply epoch {ack.epoch}: {ack.error}")
            return
        if not ack.ok:
            self.pending = None
            self._transition(Trigger.ACK_FAILED, f"rank {ack.rank} could not apply epoch {ack.epoch}: {ack.error}")
            if pend.attempts >= 3:
                self._transition(Trigger.FATAL, f"epoch {ack.epoch} failed to apply 3 times; last: {ack.error}")
                return
            self._plan(None, now)
            if self.pending is not None:
                self.pending.attempts = pend.attempts + 1
            return
        pend.awaiting.discard(ack.rank)
        pend.applied_at = max(pend.applied_at, ack.iteration)
        self._maybe_acked(now)

    def _maybe_acked(self, now: float) -> None:
        pend = self.pending
        if pend is None or pend.awaiting:
            return
        self.pending = None
        if self._progress_at is not None:  # the switch's pause was no hang: its clock starts now
            self._progress_at = now
        cmd = pend.command
        self.plan = cmd.plan
        self.journal.acked(cmd.seq)
        if pend.adopted_at is None:
            # ranks that got the command late switch together a boundary or two after apply_at
            self._adopt(cmd.plan, max(cmd.apply_at, pend.applied_at), now)
        self.metrics.set("resihp_epoch", self.epoch, {"job": self.config.job})
        self.metrics.set("resihp_command_ack_duration_seconds", now - pend.issued_at, {"job": self.config.job})
        self._transition(Trigger.ACKED, f"every live rank acknowledged epoch {cmd.epoch} "
                                        f"in {now - pend.issued_at:.3f} s")
        self._notify("acked", cmd)
        self._drain_queue(now)

    def _on_audit(self, verdict: AuditVerdict, previous: Plan, new: Plan, cause: m.FindingInfo, now: float) -> None:
        """The verdict on the planner's last switch: kept, or undone when it measured slower."""
        regret = verdict.regret and self.policy["plan_audit"] == "on"
        self.metrics.set("resihp_plan_audit_ratio", verdict.ratio, {"job": self.config.job})
        unusable = sorted(r for r in (*previous.ranks(), *previous.spares)
                          if self.ranks[r].dead or (r in self.excluded and previous.has_rank(r)))
        if not regret:
            outcome = "kept"
        elif unusable:
            outcome = f"kept: the previous plan needs ranks {unusable}, which are dead or excluded"
        elif self.state not in (State.RUNNING, State.SUSPECT):
            outcome = f"kept: the coordinator is {self.state.value}"
        else:
            outcome = "undone"
        self.events.emit("plan-audit", old_epoch=verdict.old_epoch, new_epoch=verdict.new_epoch,
                         before_s=round(verdict.before_s, 6), after_s=round(verdict.after_s, 6),
                         ratio=round(verdict.ratio, 4), regret=verdict.regret, outcome=outcome,
                         reason=f"{verdict.describe()}; {outcome}")
        if outcome != "undone":
            return
        why = (f"the re-plan for the {cause.kind} of ranks {list(cause.ranks)} measured slower: "
               f"{verdict.describe()}")
        self.journal.regret(self.audits.regret(cause, previous, new, why).to_json())
        self.metrics.inc("resihp_plan_regrets_total", 1, {"job": self.config.job})
        self._transition(Trigger.REGRET, why)
        self._command(previous, f"regret: {why}; back to the previous layout", "regret", now)

    def _trainers_epoch(self, epoch: int, now: float) -> None:
        """The trainers moved to a newer epoch on their own: a recovery in which nobody died (the
        store restarted under a boundary's agreement) or no plan came from this coordinator. They
        keep the layout; the coordinator takes their epoch, so its reports are joined again and
        its next command is newer than what the trainers run."""
        old = self.epoch
        self.epoch = epoch
        self.plan = replace(self.plan, epoch=epoch)
        self.joiner.add_plan(self.plan)
        self.journal.plan(self.plan)
        self._adopt(self.plan, max(self.last_iteration, 0), now)
        self.events.emit("epoch-adopted", epoch=epoch,
                         reason=f"the trainers run epoch {epoch} (this coordinator was at {old}): they recovered "
                                f"without a plan from it; it follows them with the same layout")

    def _supersede(self, f: m.FindingInfo, now: float) -> bool:
        """A rank the outstanding plan needs died before every rank acknowledged it: no survivor
        can take that plan (their recovery waits for one that uses only survivors), so a plan
        without every dead rank is commanded at once — one recovery for both deaths, not a
        wait for the first plan's ack timeout. False when the outstanding plan does not need it."""
        pend = self.pending
        needed = set(pend.command.plan.ranks()) | set(pend.command.plan.spares) if pend is not None else set()
        if pend is None or not needed.intersection(f.ranks):  # its members and spares all join the switch
            return False
        self.pending = None
        if pend.adopted_at is not None:  # its ranks already run it: re-plan from it
            self.plan = pend.command.plan
        self.events.emit("command-superseded", command_seq=pend.command.seq, epoch=pend.command.epoch,
                         reason=f"ranks {list(f.ranks)} died before every rank acknowledged epoch "
                                f"{pend.command.epoch}; a plan without them replaces it")
        self._transition(Trigger.FINDING, f"{f.kind} on ranks {list(f.ranks)} during epoch {pend.command.epoch}'s "
                                          f"switch: {f.reason}")
        self._plan(f, now, replan=self.policy["auto_reconfigure"] == "on")
        return True

    def _drain_queue(self, now: float) -> None:
        if not self.queued_findings or self.state is not State.RUNNING:
            return
        relevant = [f for f in self.queued_findings if f.kind != "fail-slow" or
                    any(not self.ranks[r].dead for r in f.ranks if 0 <= r < self.config.world_size)]
        self.queued_findings = []
        if relevant:
            f = relevant[-1]
            self._transition(Trigger.FINDING, f"queued {f.kind} on ranks {list(f.ranks)}: {f.reason}")
            self._plan(f, now, replan=self.policy["auto_reconfigure"] == "on")

    # --- periodic ---------------------------------------------------------------------
