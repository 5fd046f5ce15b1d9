"""The best layer split of one pipeline, as a function of its micro-batch count.

For m micro-batches a pipeline with stage times t_s = e_s + l_s·a_s takes
``(m − 1)·max t_s + β·Σ t_s`` (e_s holds the stage's p2p sends: Costs.extra_s). For a
bound C on the bottleneck every stage can take at most ``min(cap_s, ⌊(C − e_s)/a_s⌋)`` layers
(cap_s: what fits in memory with the in-flight micro-batches), and the cheapest way to place L layers under that bound is greedy: fastest
stages first. The optimum's own bottleneck is one of the values ``e_s + j·a_s``, so trying
them from the smallest feasible upwards (stopping once the bound alone costs more than the
best found) is exact. Beyond a threshold m the min-bottleneck split is optimal and the time
is affine in m, which lets the share allocation invert it in O(1). Pure.
"""
from __future__ import annotations

import bisect
import math

from resihp.coordinator.planner.cost import INF, Costs, PipeSig
from resihp.coordinator.planner.shares import max_m_search

Split = tuple[float, tuple[int, ...]]


class PipeProfile:
    """Time and split of one pipeline signature for any micro-batch count (memoised)."""

    def __init__(self, costs: Costs, sig: PipeSig) -> None:
        self.costs = costs
        self.sig = sig
        p = self.p = len(sig.stages)
        self.v = costs.v
        self.n_layers = costs.spec.num_layers
        self.a = [costs.per_layer_s(k, sp) for (k, sp, _) in sig.stages]
        self.e = [costs.extra_s(k, sp, s == 0, s == p - 1) for s, (k, sp, _) in enumerate(sig.stages)]
        # fastest stages take extra layers first; on ties the ones without the embedding or
        # LM head (their shard is smaller, which shortens the DP all-reduce), then middle-out
        self.order = sorted(range(p), key=lambda s: (self.a[s], (s == 0) + (s == p - 1), s))
        self.beta = costs.beta
        # in-flight counts (hence memory caps) stop changing once m reaches m_sat
        self.m_sat = p * (self.v + 1) if self.v > 1 else p
        self._memo: dict[int, Split | None] = {}
        self._cands: dict[int, tuple[list[float], list[int]] | None] = {}
        self._all: list[float] | None = None
        self._affine: tuple[int, float, float, tuple[int, ...]] | None | bool = False

    # --- building blocks ---------------------------------------------------------------
    def _candidates(self, mkey: int) -> tuple[list[float], list[int]] | None:
        """Sorted candidate bottleneck values and the memory caps for m = mkey. The values
        are generated once with the loosest caps (m = 1); extra values are harmless because
        feasibility is always checked against the real caps."""
        if mkey in self._cands:
            return self._cands[mkey]
        costs, p, v = self.costs, self.p, self.v
        caps = [
            min(self.n_layers - (p - 1) * v, costs.layer_cap(key, s == 0, s == p - 1, costs.inflight(p, s, mkey)))
            for s, key in enumerate(self.sig.stages)
        ]
        out: tuple[list[float], list[int]] | None = None
        if p * v <= self.n_layers and all(c >= v for c in caps) and sum(caps) >= self.n_layers:
            if self._all is None:
                loose = [
                    min(self.n_layers - (p - 1) * v, costs.layer_cap(key, s == 0, s == p - 1, costs.inflight(p, s, 1)))
                    for s, key in enumerate(self.sig.stages)
                ]
                cands = [self.e[s] + j * self.a[s] for s in range(p) for j in range(v, loose[s] + 1)]
                cands.sort()
                self._all = cands
            out = (self._all, caps)
        self._cands[mkey] = out
        return out

    def _caps_at(self, caps: list[int], c: float) -> list[int] | None:
        # the search's innermost loop: locals and zip instead of indexing (about 2x faster)
        v = self.v
        n = []
        for cap, e, a in zip(caps, self.e, self.a):
            q = int((c - e) / a + 1e-9)
            if cap < q:
                q = cap
            if q < v:
                return None
            n.append(q)
        return n if sum(n) >= self.n_layers else None

    def _fill(self, n: list[int]) -> tuple[list[int], float, float]:
        v = self.v
        layers = [v] * self.p
        rest = self.n_layers - v * self.p
        for s in self.order:
            if rest <= 0:
                break
            add = n[s] - v
            if rest < add:
                add = rest
            layers[s] += add
            rest -= add
        times = [e + k * a for e, k, a in zip(self.e, layers, self.a)]
        return layers, sum(times), max(times)

    def _min_feasible(self, cands: list[float], caps: list[int]) -> int:
        """Index of the smallest feasible bottleneck: start at the continuous relaxation
        (layers spread in proportion to stage speed, caps ignored), gallop, then bisect."""
        inv = sum(1.0 / x for x in self.a)
        relaxed = (self.n_layers + sum(ei / ai for ei, ai in zip(self.e, self.a))) / inv
        floor_c = max(relaxed, max(self.e[s] + self.v * self.a[s] for s in range(self.p)))
        lo = bisect.bisect_left(cands, floor_c * (1 - 1e-12))
        last = len(cands) - 1
        if lo > last:
            return last
        if self._caps_at(caps, cands[lo]) is not None:
            return lo
        step = 1
        hi = min(last, lo + step)
        while hi < last and self._caps_at(caps, cands[hi]) is None:
            lo = hi
            step *= 2
            hi = min(last, lo + step)
        while hi - lo > 1:  # cands[lo] infeasible, cands[hi] feasible (or the last)
            mid = (lo + hi) // 2
            if self._caps_at(caps, cands[mid]) is None:
                lo = mid
            else:
                hi = mid
        return hi

    def _solve(self, m: int) -> Split | None:
        got = self._candidates(max(1, min(m, self.m_sat)))
        if got is None:
            return None
        cands, caps = got
        start = self._min_feasible(cands, caps)
        if self._caps_at(caps, cands[start]) is None:
            return None
        m_eff = max(m, 1)
        floor_sum = self._fill(caps)[1]
        best: Split | None = None
        last_c = -1.0
        for idx in range(start, len(cands)):
            c = cands[idx]
            if c == last_c:
                continue
            last_c = c
            if best is not None and (m_eff - 1) * c + self.beta * floor_sum >= best[0]:
                break
            n = self._caps_at(caps, c)
            assert n is not None
            layers, total, peak = self._fill(n)
            obj = (m_eff - 1) * peak + self.beta * total
            if best is None or obj < best[0] - 1e-15:
                best = (obj, tuple(layers))
            if m_eff == 1 and total <= floor_sum + 1e-15:
                break
        if best is not None and m_eff == 1:
            best = (best[0], self._smallest_shards(list(best[1]), caps))
        return best

    def _smallest_shards(self, layers: list[int], caps: list[int]) -> tuple[int, ...]:
        """One micro-batch costs Σ t_s whatever the split among stages of equal per-layer
        time, but the DP all-reduce and the optimizer wait for the largest parameter shard:
        spread each such group's layers to make that shard as small as possible (the
        exhaustive search breaks the same ties the same way)."""
        costs, p = self.costs, self.p
        k = [key[0] for key in self.sig.stages]
        fixed = [(costs.emb_params if s == 0 else 0) + (costs.emb_params if s == p - 1 else 0) for s in range(p)]
        groups: dict[float, list[int]] = {}
        for s in range(p):
            groups.setdefault(round(self.a[s], 15), []).append(s)
        for members in groups.values():
            if len(members) < 2:
                continue
            total = sum(layers[s] for s in members)
            for s in members:
                layers[s] = self.v
            for _ in range(total - self.v * len(members)):  # water-filling: few layers, few stages
                s = min((s for s in members if layers[s] < caps[s]),
                        key=lambda s: ((layers[s] + 1) * costs.layer_params + fixed[s]) / k[s])
                layers[s] += 1
        return tuple(layers)

    def _affine_part(self) -> tuple[int, float, float, tuple[int, ...]] | None:
        """(m_aff, bottleneck, β·Σt, layers): for m ≥ m_aff the time is
        (m − 1)·bottleneck + rest with this split."""
        if self._affine is not False:
            return self._affine  # type: ignore[return-value]
        got = self._candidates(self.m_sat)
        res: tuple[int, float, float, tuple[int, ...]] | None = None
        if got is not None:
            cands, caps = got
            start = self._min_feasible(cands, caps)
            n = self._caps_at(caps, cands[start])
            if n is not None:
                layers, total, peak = self._fill(n)
                floor_sum = self._fill(caps)[1]
                nxt = bisect.bisect_right(cands, peak + 1e-15 * max(1.0, peak))
                m_aff = self.m_sat
                if nxt < len(cands) and total > floor_sum:
                    gap = cands[nxt] - peak
                    m_aff = max(m_aff, 1 + math.ceil(self.beta * (total - floor_sum) / gap) + 1)
                res = (m_aff, peak, self.beta * total, tuple(layers))
        self._affine = res
        return res

    # --- public ---------------------------------------------------------------------------
    def best(self, m: int) -> Split | None:
        """(time, layers per device) for m micro-batches; None when nothing fits."""
        hit = self._memo.get(m, False)
        if hit is not False:
            return hit  # type: ignore[return-value]
        aff = self._affine_part() if m >= self.m_sat else None
        if aff is not None and m >= aff[0]:
            res: Split | None = ((m - 1) * aff[1] + aff[2], aff[3])
        else:
            res = self._solve(m)
            if m == 0 and res is not None:
                res = (0.0, res[1])
        self._memo[m] = res
        return res

    def time(self, m: int) -> float:
        if m == 0:
            return 0.0
        res = self.best(m)
        return INF if res is None else res[0]

    def max_m(self, tau: float, limit: int) -> int:
        """Largest m in [0, limit] with time(m) <= tau."""
        aff = self._affine_part()
        if aff is not None and limit > aff[0] and self.time(aff[0]) <= tau:
            m = min(limit, int((tau - aff[2]) / aff[1]) + 1 if aff[1] > 0 else limit)
            while m > aff[0] and self.time(m) > tau:
                m -= 1
            while m < limit and self.time(m + 1) <= tau:
                m += 1
            return m
        return max_m_search(self.time, tau, 0, limit if aff is None else min(limit, aff[0]))


def profile(costs: Costs, sig: PipeSig) -> PipeProfile:
    hit = costs.profiles.get(sig.stages)
    if isinstance(hit, PipeProfile):
        return hit
    prof = PipeProfile(costs, sig)
    costs.profiles[sig.stages] = prof
    return prof
