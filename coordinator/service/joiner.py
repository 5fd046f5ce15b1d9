"""Join per-rank reports of one iteration into a trace ``IterationRecord``.

An iteration is emitted when every live rank of its plan has reported, or ``grace_s``
after its first report (late and missing ranks are tolerated: the record simply lacks
them), or as soon as a later iteration is emitted — records leave in iteration order.
Reports for an iteration already emitted are counted as late and dropped. Pure: time is
passed in, no grpc.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ChunkTiming, IterationRecord
from resihp.coordinator.protocol.messages import RankReport


@dataclass
class _Pending:
    first_seen: float
    epoch: int
    reports: dict[int, RankReport] = field(default_factory=dict)


class Joiner:
    def __init__(self, plan: Plan, t0: float, grace_s: float = 2.0, max_pending: int = 256) -> None:
        if grace_s <= 0:
            raise ValueError(f"join grace must be > 0 seconds, got {grace_s}")
        self.t0 = t0  # wall-clock origin: records carry job-relative times
        self.grace_s = grace_s
        self.max_pending = max_pending
        self._plans: dict[int, Plan] = {plan.epoch: plan}
        self._pending: dict[int, _Pending] = {}
        self._last_seqlens: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self.last_emitted = -1
        self.late = 0
        self.dropped = 0  # iterations that could not be built (no seqlens for a replica)
        self._expect_key: tuple[int, frozenset[int]] | None = None
        self._expect: frozenset[int] | None = None
        # the plan epoch each emitted record was built with (the caller pops it): records of a
        # plan the detector has not adopted yet, or no longer runs, must not be judged by it
        self.epoch_of: dict[int, int] = {}

    def add_plan(self, plan: Plan) -> None:
        self._plans[plan.epoch] = plan

    def resume_after(self, iteration: int) -> None:
        """After a restart: iterations up to ``iteration`` were already emitted."""
        self.last_emitted = max(self.last_emitted, iteration)

    def plan_for(self, epoch: int) -> Plan | None:
        if epoch in self._plans:
            return self._plans[epoch]
        older = [e for e in self._plans if e <= epoch]
        return self._plans[max(older)] if older else None

    def _epoch_for(self, epoch: int) -> int:
        plan = self.plan_for(epoch)
        return epoch if plan is None else plan.epoch

    def add(self, report: RankReport, now: float, live: frozenset[int]) -> list[IterationRecord]:
        if report.iteration <= self.last_emitted:
            self.late += 1
            return []
        pend = self._pending.get(report.iteration)
        if pend is None:
            pend = self._pending[report.iteration] = _Pending(now, report.epoch)
        pend.epoch = max(pend.epoch, report.epoch)
        pend.reports[report.rank] = report
        out: list[IterationRecord] = []
        if self._complete(pend, live):
            out = self._emit_through(report.iteration)
        if len(self._pending) > self.max_pending:  # a rank far ahead: bound memory
            out += self._emit_through(min(self._pending))
        return out

    def flush(self, now: float, live: frozenset[int]) -> list[IterationRecord]:
        """Emit iterations whose grace expired or that became complete (a rank died)."""
        ready = [it for it, p in self._pending.items() if now - p.first_seen >= self.grace_s or self._complete(p, live)]
        return self._emit_through(max(ready)) if ready else []

    def _expected(self, epoch: int, live: frozenset[int]) -> frozenset[int] | None:
        key = (epoch, live)
        if self._expect_key != key:  # cached: recomputed when the plan or the live set changes
            plan = self.plan_for(epoch)
            self._expect_key = key
            self._expect = None if plan is None else frozenset(plan.ranks()) & live
        return self._expect

    def _complete(self, pend: _Pending, live: frozenset[int]) -> bool:
        expected = self._expected(pend.epoch, live)
        if expected is None or len(pend.reports) < len(expected):
            return False
        return expected.issubset(pend.reports)

    def _emit_through(self, iteration: int) -> list[IterationRecord]:
        out = []
        for it in sorted(i for i in self._pending if i <= iteration):
            pend = self._pending.pop(it)
            rec = self._build(it, pend)
            if rec is None:
                self.dropped += 1
            else:
                out.append(rec)
                self.epoch_of[it] = self._epoch_for(pend.epoch)
                while len(self.epoch_of) > self.max_pending:  # a caller that never pops: bounded
                    del self.epoch_of[next(iter(self.epoch_of))]
            self.last_emitted = max(self.last_emitted, it)
        return out

    def _build(self, iteration: int, pend: _Pending) -> IterationRecord | None:
        plan = self.plan_for(pend.epoch)
        if plan is None or not pend.reports:
            return None
        seqlens: list[tuple[tuple[int, ...], ...]] = []
        for r_idx, rep in enumerate(plan.replicas):
            found = None
            for rank in rep.ranks():
                got = pend.reports.get(rank)
                if got is not None and len(got.seqlens) == rep.microbatches:
                    found = got.seqlens
                    break
            key = (plan.epoch, r_idx)
            if found is None:
                found = self._last_seqlens.get(key)  # a replica that stayed silent: last known batch
                if found is None:
                    return None
            self._last_seqlens[key] = found
            seqlens.append(found)
        reports = [pend.reports[r] for r in sorted(pend.reports)]
        start = min(r.start_s for r in reports)
        chunks: list[ChunkTiming] = [c for r in reports for c in r.chunks]
        # the iteration lasts as long as its slowest rank's step
        return IterationRecord(
            iteration=iteration, start_s=max(0.0, start - self.t0), time_s=max(r.step_s for r in reports),
            seqlens=tuple(seqlens), chunks=tuple(chunks), rank_step_s={r.rank: r.step_s for r in reports},
        )


def layout_mismatch(plan: Plan, rep: RankReport) -> str:
    """Why ``rep`` cannot be joined against ``plan`` ("" if it can): a rank that ran another
    number of micro-batches than the plan gives its replica was started with another layout
    than the coordinator (``--microbatches``, ``--tp/--pp/--dp``)."""
    if not plan.has_rank(rep.rank):
        return ""
    want = plan.replicas[plan.position(rep.rank).replica].microbatches
    if len(rep.seqlens) == want:
        return ""
    return (f"rank {rep.rank} ran {len(rep.seqlens)} micro-batch(es) in iteration {rep.iteration}, but this "
            f"coordinator's plan (epoch {plan.epoch}: {plan.describe()}) gives its replica {want}: the trainers and "
            f"the coordinator were started with different layouts; give the coordinator the training script's global "
            f"micro-batches and TP/PP/DP (resihp launch --microbatches / --tp / --pp / --dp). Until then its "
            f"iterations are not judged and no re-plan can fit the job")


@dataclass
class LayoutCheck:
    """The trainers' micro-batch shares against the coordinator's plan, from their reports.

    The script decides how many micro-batches a step trains; a coordinator started without
    ``--microbatches`` (or with another value) plans a different global batch. While nothing
    has been commanded (``open``), the plan follows the trainers: once one report of every
    replica is in, a plan with their shares is returned to adopt. After that — or when two
    ranks of one replica disagree — a report that does not fit the plan is a mismatch, said
    once (``said``)."""

    open: bool
    shares: dict[int, int] = field(default_factory=dict)
    said: str = ""

    def check(self, plan: Plan, rep: RankReport) -> Plan | str | None:
        """A plan with the trainers' shares to adopt, a mismatch to report, or None."""
        if self.said or not plan.has_rank(rep.rank):
            return None
        if self.open:
            replica, ran = plan.position(rep.rank).replica, len(rep.seqlens)
            if self.shares.setdefault(replica, ran) != ran:
                self.open = False  # one replica, two answers: no layout to adopt
            elif len(self.shares) < len(plan.replicas):
                return None  # every replica's first report first
            else:
                self.open = False
                shares = [self.shares[i] for i in range(len(plan.replicas))]
                if shares != [r.microbatches for r in plan.replicas] and min(shares) > 0:
                    return replace(plan, replicas=tuple(replace(r, microbatches=s)
                                                        for r, s in zip(plan.replicas, shares)))
        self.said = layout_mismatch(plan, rep)
        return self.said or None
