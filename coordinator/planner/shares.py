"""Integer micro-batch shares that minimise the makespan of data-parallel replicas.

Replicas come in classes of identical pipelines (``counts[c]`` copies whose time for m
micro-batches is ``times[c](m)``, non-decreasing in m, 0 at m = 0). The greedy rule —
give the next micro-batch to the replica that would finish it earliest — is exact for
non-decreasing T (if the optimum is τ*, some replica below its optimal share can always
take one more within τ*). Identical replicas move together, one heap pop per level, so
2,000 identical replicas cost what one does. Pure.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Protocol

INF = math.inf
TimeFn = Callable[[int], float]


class TimeModel(Protocol):
    def time(self, m: int) -> float: ...

    def max_m(self, tau: float, limit: int) -> int: ...


def max_m_search(fn: TimeFn, tau: float, lo: int, limit: int) -> int:
    """Largest m in [lo, limit] with fn(m) <= tau, given fn(lo) <= tau (fn non-decreasing)."""
    if fn(limit) <= tau:
        return limit
    hi = limit  # fn(lo) <= tau < fn(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fn(mid) <= tau:
            lo = mid
        else:
            hi = mid
    return lo


class Monotone:
    """A TimeModel from any non-decreasing function with fn(0) = 0 (memoised)."""

    def __init__(self, fn: TimeFn) -> None:
        self._fn = fn
        self._memo: dict[int, float] = {0: 0.0}

    def time(self, m: int) -> float:
        hit = self._memo.get(m)
        if hit is None:
            hit = self._fn(m)
            self._memo[m] = hit
        return hit

    def max_m(self, tau: float, limit: int) -> int:
        return max_m_search(self.time, tau, 0, limit)


class Scaled:
    """Shares in units of ``unit`` micro-batches (interleaved 1F1B needs multiples of pp)."""

    def __init__(self, model: TimeModel, unit: int) -> None:
        self.model = model
        self.unit = unit

    def time(self, m: int) -> float:
        return self.model.time(m * self.unit)

    def max_m(self, tau: float, limit: int) -> int:
        return self.model.max_m(tau, limit * self.unit) // self.unit


def allocate_shares(
    models: Sequence[TimeModel], counts: Sequence[int], total: int, unit: int = 1
) -> tuple[float, list[list[int]]] | None:
    """(makespan, shares per class member) or None when no allocation fits (every class
    infeasible, e.g. out of memory, or ``total`` not a multiple of ``unit``)."""
    if unit > 1:
        if total % unit:
            return None
        got = allocate_shares([Scaled(mod, unit) for mod in models], counts, total // unit)
        if got is None:
            return None
        return got[0], [[x * unit for x in row] for row in got[1]]
    replicas = sum(counts)
    if replicas <= 0 or total < 0:
        return None
    # greedy in batches: the group of identical replicas whose next micro-batch finishes
    # earliest takes one more each (one pop per level, not per micro-batch)
    heap: list[tuple[float, int, int, int]] = []
    for c, (mod, n) in enumerate(zip(models, counts)):
        if n > 0:
            heap.append((mod.time(1), c, 0, n))
    heapq.heapify(heap)
    levels: list[dict[int, int]] = [{} for _ in counts]
    left = total
    while left > 0:
        if not heap or heap[0][0] == INF:
            return None
        t, c, level, n = heapq.heappop(heap)
        take = min(n, left)
        left -= take
        if n - take:
            levels[c][level] = levels[c].get(level, 0) + n - take
        heapq.heappush(heap, (models[c].time(level + 2), c, level + 1, take))
    for _, c, level, n in heap:
        levels[c][level] = levels[c].get(level, 0) + n
    shares: list[list[int]] = []
    makespan = 0.0
    for c in range(len(counts)):
        row: list[int] = []
        for level in sorted(levels[c], reverse=True):
            row.extend([level] * levels[c][level])
            if level > 0:
                makespan = max(makespan, models[c].time(level))
        shares.append(row)
    return makespan, shares
