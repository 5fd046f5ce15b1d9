"""The coordinator's audit of its own re-plans (coordinator/plan_audit.py), and the faults for
which a re-plan measured slower than the plan it replaced.

Only switches the planner chose on its own are audited: a fail-slow's re-plan (was the new
layout faster than running on with the slow device?) and a recovery's readmission (was the
full layout faster than the one without it?). A fail-stop leaves no old plan to go back to,
and an operator's exclude or readmit is the operator's call.

After a regret the coordinator goes back to the old plan and keeps it for that fault: a
fail-slow finding on the same ranks keeps the layout until they recover (or die); a
recovery of the same ranks does not readmit them again (``resihp admin readmit`` still
does). The coordinator journals these verdicts, so a restarted coordinator keeps them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from resihp.coordinator import messages as m
from resihp.coordinator.plan import Plan
from resihp.coordinator.plan_audit import KEEP_BEFORE, AuditVerdict, PlanAudit

AUDITED = ("fail-slow", "recovered")
Change = tuple[str, int, str]  # (finding kind, rank, why it keeps the layout; '' = no longer)


@dataclass
class Audits:
    current: PlanAudit | None = None
    previous: Plan | None = None  # the plan the audited switch replaced
    cause: m.FindingInfo | None = None  # the finding the audited switch answered
    slow_kept: dict[int, str] = field(default_factory=dict)  # rank -> why its fail-slow keeps the layout
    readmit_kept: dict[int, str] = field(default_factory=dict)  # rank -> why its recovery does not readmit it
    # the newest joined iterations (epoch, iteration, time): the old plan's times since the
    # finding, some of which came before the command was sent
    recent: deque[tuple[int | None, int, float]] = field(default_factory=lambda: deque(maxlen=2 * KEEP_BEFORE))

    def start(self, cause: m.FindingInfo | None, previous: Plan, new: Plan, margin: float) -> None:
        """Audit the switch ``previous`` -> ``new`` (just commanded) if the planner chose it."""
        self.cancel()
        if cause is None or cause.kind not in AUDITED or previous.epoch == new.epoch:
            return
        self.current = PlanAudit(previous.epoch, new.epoch, cause.iteration, margin)
        self.previous, self.cause = previous, cause
        for epoch, iteration, time_s in self.recent:
            self.current.observe(epoch, iteration, time_s)

    def cancel(self) -> None:
        """Another command supersedes the switch under audit."""
        self.current, self.previous, self.cause = None, None, None

    def observe(self, epoch: int | None, iteration: int, time_s: float) -> tuple[AuditVerdict, Plan, m.FindingInfo] | None:
        """The verdict on the switch under audit, once there is one (then the audit is over)."""
        self.recent.append((epoch, iteration, time_s))
        audit = self.current
        if audit is None:
            return None
        verdict = audit.observe(epoch, iteration, time_s)
        if verdict is None:
            if audit.unjudgeable:
                self.cancel()  # the old plan ran too briefly after the finding to compare with
            return None
        assert self.previous is not None and self.cause is not None
        out = (verdict, self.previous, self.cause)
        self.cancel()
        return out

    def regret(self, cause: m.FindingInfo, why: str) -> list[Change]:
        kept = self._kept(cause.kind)
        for r in cause.ranks:
            kept[r] = why
        return [(cause.kind, r, why) for r in cause.ranks]

    def verdicts(self) -> dict[int, str]:
        """Per rank, what the audit keeps for it (``resihp admin status``)."""
        out: dict[int, list[str]] = {}
        for kind in AUDITED:
            for r, why in self._kept(kind).items():
                out.setdefault(r, []).append(f"a {kind} keeps the layout: {why}")
        return {r: "; ".join(lines) for r, lines in out.items()}

    def _kept(self, kind: str) -> dict[int, str]:
        return self.slow_kept if kind == "fail-slow" else self.readmit_kept

    def kept(self, finding: m.FindingInfo | None) -> str:
        """Why ``finding`` keeps the layout (a re-plan for this fault measured slower), or ''."""
        if finding is None or finding.kind not in AUDITED:
            return ""
        kept = self.slow_kept if finding.kind == "fail-slow" else self.readmit_kept
        hit = [r for r in finding.ranks if r in kept]
        if not hit or (finding.kind == "recovered" and len(hit) < len(finding.ranks)):
            return ""
        return (f"keeping the layout for the {finding.kind} of ranks {list(finding.ranks)}: {kept[hit[0]]} "
                f"(kept until the ranks recover or die; `resihp admin readmit` overrides)")

    def forget(self, finding: m.FindingInfo) -> list[Change]:
        """A fault is over: a recovery ends a fail-slow's regret, a death both kinds."""
        kinds = {"recovered": ("fail-slow",), "fail-stop": AUDITED}.get(finding.kind, ())
        return self._clear(finding.ranks, kinds)

    def overrule(self, rank: int) -> list[Change]:
        """The operator excluded or readmitted ``rank``: their call, not the audit's."""
        return self._clear((rank,), AUDITED)

    def _clear(self, ranks: tuple[int, ...], kinds: tuple[str, ...]) -> list[Change]:
        out: list[Change] = []
        for kind in kinds:
            kept = self._kept(kind)
            out += [(kind, r, "") for r in ranks if kept.pop(r, None) is not None]
        return out

    def restore(self, changes: list[Change]) -> None:
        """Replay journaled changes (a restarted coordinator)."""
        for kind, r, why in changes:
            if kind in AUDITED:
                if why:
                    self._kept(kind)[r] = why
                else:
                    self._kept(kind).pop(r, None)
