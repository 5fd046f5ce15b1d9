"""The coordinator's audit of its own re-plans (coordinator/planner/audit.py), and the faults for
which a re-plan measured slower than the plan it replaced.

Only switches the planner chose on its own are audited: a fail-slow's re-plan (was the new
layout faster than running on with the slow device?) and a recovery's readmission (was the
full layout faster than the one without it?). A fail-stop leaves no old plan to go back to,
and an operator's exclude or readmit is the operator's call.

After a regret the coordinator goes back to the old plan and keeps it for that fault: a
fail-slow finding on the same ranks keeps the layout until they recover (or die); a
recovery of the same ranks does not readmit them again (``resihp admin readmit`` still
does); and the planner's answer to *any* finding is refused while it is the very switch
that measured slower (a slow link is also seen through its ring partners, whose findings
the planner answers with the same layout). When the ranks recover, the fault's hold ends
but the switch stays refused (kind ``switch``): it measured slower than the old layout
*with* the slow device in it, so it is slower still without (on shared CPUs the planner
kept proposing the same 3x slower layout at every recovery). A death or an operator's
exclude / readmit of its ranks ends that too. So does a fail-slow finding on them whose factor
moved by ``MOVED`` or more from the one the regretted re-plan answered (the detector reports
a slow rank again when its slowdown moves: coordinator/detector/drift.py): the layout was
kept for a 2x device, and a 4x one is another trade-off — the planner is asked again, and
the switch that measured slower stays refused. The coordinator journals these regrets, so a
restarted coordinator keeps them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.planner.audit import KEEP_BEFORE, AuditVerdict, PlanAudit
from resihp.coordinator.protocol import messages as m

AUDITED = ("fail-slow", "recovered")
# a fail-slow whose factor moved this share from the one a regret's re-plan answered (either
# way) is no longer the fault the regret judged (the detector's factor_drift default)
MOVED = 0.3


def layout(plan: Plan) -> Plan:
    """A plan without its epoch and reason: what two plans share when they run alike."""
    return replace(plan, epoch=0, reason="")


def grouping(plan: Plan) -> tuple[object, ...]:
    """How a plan groups the ranks (each replica's stages' TP groups, the schedule and its
    chunks, the spares), without its layer split or micro-batch shares."""
    return (plan.schedule, plan.virtual_chunks, tuple(rep.stages for rep in plan.replicas), plan.spares)


@dataclass(frozen=True)
class Regret:
    """A switch the planner chose for a ``kind`` finding on ``ranks`` that measured slower."""

    id: int
    kind: str
    ranks: tuple[int, ...]
    before: Plan  # layouts (see ``layout``)
    after: Plan
    why: str
    factor: float = 0.0  # the slowdown of the finding the switch answered (0: not known)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "ranks": list(self.ranks), "before": self.before.to_dict(),
                "after": self.after.to_dict(), "reason": self.why, "factor": self.factor}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Regret:
        # journals written before the factor was kept have none: 0, never moved from
        return cls(int(d["id"]), str(d["kind"]), tuple(int(r) for r in d["ranks"]), layout(Plan.from_dict(d["before"])),
                   layout(Plan.from_dict(d["after"])), str(d["reason"]), float(d.get("factor", 0.0)))

    def moved(self, finding: m.FindingInfo) -> bool:
        """Whether ``finding`` (a fail-slow on these ranks) reports a slowdown ``MOVED`` or
        more away from the one this switch answered."""
        old, new = self.factor, float(finding.factor)
        return old > 0 and new > 0 and max(new / old, old / new) >= 1.0 + MOVED


@dataclass
class Audits:
    current: PlanAudit | None = None
    previous: Plan | None = None  # the plan the audited switch replaced
    new: Plan | None = None  # the audited switch's plan
    cause: m.FindingInfo | None = None  # the finding the audited switch answered
    regrets: dict[int, Regret] = field(default_factory=dict)
    # the newest joined iterations (epoch, iteration, time): the old plan's times since the
    # finding, some of which came before the command was sent
    recent: deque[tuple[int | None, int, float]] = field(default_factory=lambda: deque(maxlen=2 * KEEP_BEFORE))

    def start(self, cause: m.FindingInfo | None, previous: Plan, new: Plan, margin: float) -> None:
        """Audit the switch ``previous`` -> ``new`` (just commanded) if the planner chose it."""
        self.cancel()
        if cause is None or cause.kind not in AUDITED or previous.epoch == new.epoch:
            return
        self.current = PlanAudit(previous.epoch, new.epoch, cause.iteration, margin)
        self.previous, self.new, self.cause = previous, new, cause
        for epoch, iteration, time_s in self.recent:
            self.current.observe(epoch, iteration, time_s)

    def cancel(self) -> None:
        """Another command supersedes the switch under audit."""
        self.current, self.previous, self.new, self.cause = None, None, None, None

    def observe(self, epoch: int | None, iteration: int,
                time_s: float) -> tuple[AuditVerdict, Plan, Plan, m.FindingInfo] | None:
        """The verdict on the switch under audit (with its old plan, its new plan and the finding it
        answered), once there is one; then the audit is over."""
        self.recent.append((epoch, iteration, time_s))
        audit = self.current
        if audit is None:
            return None
        verdict = audit.observe(epoch, iteration, time_s)
        if verdict is None:
            if audit.unjudgeable:
                self.cancel()  # the old plan ran too briefly after the finding to compare with
            return None
        assert self.previous is not None and self.cause is not None and self.new is not None
        out = (verdict, self.previous, self.new, self.cause)
        self.cancel()
        return out

    def regret(self, cause: m.FindingInfo, before: Plan, after: Plan, why: str) -> Regret:
        r = Regret(max(self.regrets, default=0) + 1, cause.kind, tuple(cause.ranks), layout(before), layout(after), why,
                   float(cause.factor) if cause.kind == "fail-slow" else 0.0)
        self.regrets[r.id] = r
        return r

    def kept(self, finding: m.FindingInfo | None) -> str:
        """Why ``finding`` keeps the layout (a re-plan for this fault measured slower), or ''."""
        if finding is None or finding.kind not in AUDITED:
            return ""
        for r in self.regrets.values():
            hit = set(finding.ranks) & set(r.ranks)
            if r.kind == finding.kind and hit and (finding.kind == "fail-slow" or set(finding.ranks) <= set(r.ranks)):
                return (f"keeping the layout for the {finding.kind} of ranks {list(finding.ranks)}: {r.why} "
                        f"(kept until the ranks recover or die; `resihp admin readmit` overrides)")
        return ""

    def refused(self, current: Plan, proposed: Plan) -> str:
        """Why the switch ``current`` -> ``proposed`` is refused (it measured slower), or ''. A
        switch that regrouped the ranks (other TP groups, stages or replicas) is refused
        whatever layer split or shares the planner gives the same grouping next time (a split
        moves a few layers; it does not undo a 3x slower grouping: the planner came back with
        5-3 after 4-4 had measured 3x slower); one that kept the grouping, only exactly."""
        for r in self.regrets.values():
            if r.before == layout(current) and r.after == layout(proposed):
                return f"keeping the layout: the planner's answer is the switch that measured slower: {r.why}"
            regrouped = grouping(r.before) != grouping(r.after)
            if regrouped and grouping(r.before) == grouping(current) and grouping(r.after) == grouping(proposed):
                return (f"keeping the layout: the planner's answer regroups the ranks as the switch that measured "
                        f"slower did: {r.why}")
        return ""

    def verdicts(self) -> dict[int, str]:
        """Per rank, what the audit keeps for it (``resihp admin status``)."""
        out: dict[int, list[str]] = {}
        for r in self.regrets.values():
            for rank in r.ranks:
                out.setdefault(rank, []).append(f"the switch that measured slower is not made again: {r.why}"
                                                if r.kind == "switch" else f"a {r.kind} keeps the layout: {r.why}")
        return {rank: "; ".join(lines) for rank, lines in out.items()}

    def forget(self, finding: m.FindingInfo) -> tuple[list[int], list[Regret]]:
        """A fault is over: a recovery ends a fail-slow's hold on the layout (its switch stays
        refused: kept as kind ``switch``), and so does a fail-slow of the same ranks whose
        factor moved (``Regret.moved``); a death ends every kind. (The ids dropped, the regrets
        that became ``switch``.)"""
        touched = set(finding.ranks)
        if finding.kind == "fail-stop":
            return self._drop(lambda r: bool(set(r.ranks) & touched)), []
        if finding.kind not in ("recovered", "fail-slow"):
            return [], []
        kept = [replace(r, kind="switch") for r in self.regrets.values() if r.kind == "fail-slow" and set(r.ranks) & touched
                and (finding.kind == "recovered" or r.moved(finding))]
        for r in kept:
            self.regrets[r.id] = r
        return [], kept

    def overrule(self, rank: int) -> list[int]:
        """The operator excluded or readmitted ``rank``: their call, not the audit's. The ids dropped."""
        return self._drop(lambda r: rank in r.ranks)

    def _drop(self, which: Callable[[Regret], bool]) -> list[int]:
        gone = [i for i, r in self.regrets.items() if which(r)]
        for i in gone:
            del self.regrets[i]
        return gone
