"""Did a re-plan pay off? The measured iteration time of a new plan against the plan it replaced.

The planner chooses from a model (device speed, link bandwidth, the schedule); when the
model is wrong about this cluster (a profile that overrates a network, cores that the ranks
share) it can choose a plan that is slower in fact than the degraded plan it replaced. This
audit is the coordinator's safety net: after a switch the planner chose on its own (a
fail-slow, a recovery), it compares the median iteration time of the old plan since the
finding with that of the new plan after a few warm-up iterations. If the new plan is slower
by more than ``margin``, the coordinator goes back to the old plan and keeps it for that
fault (coordinator/service/audit.py). Pure: no clock, no I/O.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

WARMUP = 2  # first iterations of a new plan not judged (stage rebuilds, allocator, caches)
WINDOW = 5  # iterations of the new plan judged (median)
MIN_BEFORE = 2  # iterations of the old plan needed since the finding
KEEP_BEFORE = 8  # the newest iterations of the old plan kept


@dataclass(frozen=True)
class AuditVerdict:
    old_epoch: int
    new_epoch: int
    before_s: float  # median iteration time of the old plan since the finding
    after_s: float  # median of the new plan after WARMUP iterations
    margin: float
    samples: tuple[int, int]  # how many iterations each median is of

    @property
    def ratio(self) -> float:
        return self.after_s / self.before_s

    @property
    def regret(self) -> bool:
        return self.after_s > self.before_s * (1.0 + self.margin)

    def describe(self) -> str:
        word = "slower" if self.ratio > 1.0 else "faster"
        return (f"epoch {self.new_epoch} runs {self.after_s:.3f} s/iteration against {self.before_s:.3f} s of epoch "
                f"{self.old_epoch} since the finding ({abs(self.ratio - 1.0):.0%} {word}; medians of "
                f"{self.samples[1]} and {self.samples[0]} iterations)")


@dataclass
class PlanAudit:
    """One switch under audit: feed it every joined iteration (its plan epoch and time)."""

    old_epoch: int
    new_epoch: int
    since_iteration: int  # the finding's iteration: the old plan's times from here on show the fault
    margin: float
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    _seen_new: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0.0):
            raise ValueError(f"audit margin must be a finite number >= 0, got {self.margin!r}")

    def observe(self, epoch: int | None, iteration: int, time_s: float) -> AuditVerdict | None:
        """The verdict once the new plan has run WARMUP + WINDOW iterations, else None."""
        if not (math.isfinite(time_s) and time_s > 0.0):
            return None  # a record without a usable time says nothing about either plan
        if epoch == self.old_epoch and iteration >= self.since_iteration:
            self.before = (self.before + [time_s])[-KEEP_BEFORE:]
        elif epoch == self.new_epoch:
            self._seen_new += 1
            if self._seen_new > WARMUP:
                self.after.append(time_s)
        if len(self.after) < WINDOW or len(self.before) < MIN_BEFORE:
            return None
        return AuditVerdict(self.old_epoch, self.new_epoch, statistics.median(self.before),
                            statistics.median(self.after), self.margin, (len(self.before), len(self.after)))

    @property
    def unjudgeable(self) -> bool:
        """The new plan is running and the old one left too few iterations since the finding."""
        return self._seen_new > 0 and len(self.before) < MIN_BEFORE
