"""A slow rank's factor, followed after its finding (``FactorDrift``).

A fail-slow finding tells the planner how slow the rank is, and the planner sizes the rank's
share of the work by it. Slowdowns do not hold still: a GPU that throttles for heat gets
slower as it heats, a congested link eases, an in-flight finding (``inflight.py``) estimates
from part of one iteration. A rank whose slowdown has since moved far from what was reported
runs a plan sized for another device — more work than it can do, or less than it could.

So the detector keeps each slow rank's latest ratios, and when most of each half of that
window has moved at least ``share`` away from the factor last reported, the same way (2.1x ->
3x, or 3x -> 1.5x), the rank is reported again with the window's median as its factor, and the
planner can re-plan for it. A move down to under 1 + ``share`` is not reported: a slowdown
that ended is the recovery test's to judge. A median of several
iterations, not one: on shared hosts one iteration's ratio of a 1.3x rank swings from 1.1 to
1.7. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

# a key's move must be this many of its healthy relative spreads too (``push``)
SPREADS = 3.0


class FactorDrift:
    """Per slow rank (keyed by rank, so it outlives a plan change's new positions): the factor
    last reported and its latest ratios. ``share`` 0 follows nothing."""

    def __init__(self, share: float, iters: int) -> None:
        if iters < 2:
            raise ValueError(f"FactorDrift: iters must be >= 2 (a window of two halves), got {iters}")
        self.share = share
        self.iters = iters
        self.reported: dict[int, float] = {}
        self._recent: dict[int, deque[float]] = {}

    def start(self, rank: int, factor: float) -> None:
        """A finding reported ``rank`` slow by ``factor``: follow it from there."""
        if math.isfinite(factor) and factor > 0:
            self.reported[rank] = factor
            self._recent[rank] = deque(maxlen=self.iters)

    def stop(self, rank: int) -> None:
        """``rank`` recovered or died: nothing to follow."""
        self.reported.pop(rank, None)
        self._recent.pop(rank, None)

    def new_plan(self) -> None:
        """Ratios of the old layout are not compared with the new one's."""
        for recent in self._recent.values():
            recent.clear()

    def push(self, rank: int, ratio: float, spread: float = 0.0) -> tuple[float, float] | None:
        """One iteration's ratio of slow ``rank``. Returns (the factor reported before, its
        factor now — the median of its latest ``iters`` ratios) when that moved at least
        ``share`` from the one reported, else None. The new factor is the reported one from
        then on. ``spread``: the
        relative spread of one iteration's ratio of this key when healthy; a noisy key must
        move ``SPREADS`` of them (the factor reported first is one iteration's ratio: under
        30 % transfer jitter a 3x ring read 4.2, then 2.9, then 4.5 in medians of 8)."""
        if self.share <= 0 or rank not in self.reported or not math.isfinite(ratio) or ratio <= 0:
            return None
        recent = self._recent[rank]
        recent.append(ratio)
        if len(recent) < self.iters:
            return None
        noise = SPREADS * spread if math.isfinite(spread) and spread > 0 else 0.0
        old, bar = self.reported[rank], 1.0 + max(self.share, noise)
        # most of each half of the window moved, the same way: a step change is reported once,
        # at its new level (not first halfway, with a median over both sides of the step, and
        # then again), and a burst shorter than most of the window is not reported at all
        values = list(recent)
        half = len(values) // 2
        halves = (sorted(values[:half]), sorted(values[half:]))
        up = all(h[(len(h) - 1) // 2] >= old * bar for h in halves)  # each half's lower median
        down = all(h[len(h) // 2] * bar <= old for h in halves)  # ... upper median
        now = statistics.median(values)
        # a slowdown that ended is the recovery test's to judge (its window is longer), not a
        # move: a transient 2x fault reads 1.0 here some iterations before it is recovered
        if not (up or (down and now >= bar)):
            return None
        self.start(rank, now)
        return old, now


__all__ = ["FactorDrift"]
