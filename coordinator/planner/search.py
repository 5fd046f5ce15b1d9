"""Joint TP / PP / DP search over the healthy devices.

1. TP groups, per node and per candidate TP size: healthy devices sorted by speed (then by
   their current TP group, so healthy groups survive unchanged) are cut into groups of the
   TP size; a group holding a slow device may shrink to the power-of-two prefix maximising
   ``k · min pᵢ`` (ResiHP's TP exclusion), the excluded members forming smaller groups.
   Variants: keep every group whole, shrink on ties, keep on ties, and on clusters of a few
   nodes halve (the slow device's group splits into two of half the size, so half of it
   keeps full speed); the remainder of a node
   whose device count is not a multiple of the TP size forms smaller groups from its
   slowest or ("-lead") its fastest devices. On small clusters (≤ 8 nodes) the weakest
   r nodes may also use half the TP size (mixed-TP layouts).
2. Symmetry: a group is reduced to its type (k, min speed, min memory); identical healthy
   nodes give identical types, so a pool of 16,384 devices is a handful of (type, count).
3. Shapes (variant, tp, pp, dp) are ranked by a lower bound — the layer work spread over the
   chosen groups plus the bubble of the fastest one plus the DP all-reduce of the smallest
   possible shard — and evaluated best-bound first until the bound exceeds the best time.
4. A shape takes the dp·pp fastest groups and arranges them into pipelines concentrated
   (slow groups share pipelines), spread (one per pipeline) or, on small clusters, snaked
   (the fastest paired with the slowest); on small clusters the best arrangement is then
   improved by swapping groups between pipelines while that helps (a weak group between
   two strong ones beside a uniform pipeline, which no fixed arrangement yields). Identical
   pipelines form classes. Each class gets its stage order (which type runs the embedding
   and the LM head), its exact min-max layer split, and the classes share the global batch
   by exact water-filling (planner_shares).
5. The best shapes are materialised into concrete Plans (planner.placement: groups popped in
   current-plan order, so unaffected replicas keep their ranks and state); among plans within
   ``equal_speed_tolerance`` the one moving the least state wins.
Pure and deterministic.
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import PipelinePlan, Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.arrange import arrange, swaps
from resihp.coordinator.planner.cost import (
    INF,
    PipeSig,
    PlannerConfig,
    StageKey,
    cluster_tables,
    evaluate_with,
    largest_shard,
)
from resihp.coordinator.planner.docshares import (
    busiest_microbatches,
    document_cap,
    document_makespan,
    document_shares,
)
from resihp.coordinator.planner.groups import Pool, SearchResult, ShapeResult, _divisors, legal_tp_sizes
from resihp.coordinator.planner.move import Move, replicas_move
from resihp.coordinator.planner.placement import Placement
from resihp.coordinator.planner.shares import allocate_shares
from resihp.coordinator.planner.split import profile

# shape-search results by _shape_key: re-planning the same kind of cluster (a recovery back
# to healthy, a slow device on any node) reuses them; only materialisation is per call
_SHAPES: dict[tuple[object, ...], tuple[list[ShapeResult], int, int]] = {}

VARIANTS = ("keep", "exclude", "kmin", "keep-lead", "exclude-lead", "halve")
ARRANGEMENTS = ("concentrate", "spread", "snake")


class Searcher(Placement):
    """The shape search over ``Placement``'s pools: bound, evaluate, improve, choose."""

    MIXED_TP_MAX_NODES = 8  # up to this many nodes: mixed-TP pools and the snake arrangement
    HALVE_MAX_NODES = 4  # up to this many nodes: the "halve" TP-group variant
    SWAP_MAX_PIPELINES = 16  # improve_by_swaps on shapes of at most this many pipelines
    SWAP_WITHIN = 0.25  # ... whose best arrangement is within this of the best time
    SWAP_SEEDS = 6  # ... the best this many of them (each climb costs hundreds of evaluations)
    SWAP_BUDGET = 300  # evaluations per climb

    def __init__(
        self, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, current: Plan | None, config: PlannerConfig,
        schedule: Schedule | None = None, virtual_chunks: int | None = None,
    ) -> None:
        super().__init__(cluster, spec, batch, current, config, schedule, virtual_chunks)
        tab = cluster_tables(cluster)
        # the worst link slowdown among usable devices: shapes are priced as if their DP ring
        # and one pipeline's p2p cross it (a slow NIC makes DP-heavy layouts pay more)
        self.link = max((f for r, f in tab.slow_links.items() if r not in tab.failed), default=1.0)
        self.link = max(self.link, 1.0)
        # shares cut by the packed document (docshares): shapes are bounded and ranked so
        self._documents = config.document_shares and document_cap(self.costs) is not None
        # PlannerConfig.keep_replicas: a running job with replicas keeps two, where two fit
        self.min_dp = 2 if config.keep_replicas and current is not None and current.dp >= 2 else 1

    # --- shapes -------------------------------------------------------------------------
    def _selected(self, pool: Pool, n: int) -> list[tuple[StageKey, int]]:
        out = []
        for key, count in pool.types:
            if n <= 0:
                break
            take = min(n, count)
            out.append((key, take))
            n -= take
        return out

    def _prefix(self, pool: Pool) -> list[tuple[int, float, int, float, int, int]]:
        """Per type i, over types[0..i]: (groups, Σ rate, max k, max speed, min cap, max cap),
        so a shape's bound and memory check cost a bisection instead of a walk."""
        if pool.prefix is None:
            out = []
            n, rate, max_k, max_sp, min_cap, max_cap = 0, 0.0, 0, 0.0, 1 << 30, -(1 << 30)
            for key, count in pool.types:
                cap = self.costs.layer_cap(key, False, False, 1.0)
                n += count
                rate += pool.rate[key] * count
                max_k, max_sp = max(max_k, key[0]), max(max_sp, key[1])
                min_cap, max_cap = min(min_cap, cap), max(max_cap, cap)
                out.append((n, rate, max_k, max_sp, min_cap, max_cap))
            pool.prefix = out
        return pool.prefix

    def _upto(self, pool: Pool, n: int) -> tuple[int, float]:
        """(index of the last type used by the n fastest groups, their Σ rate)."""
        pre = self._prefix(pool)
        i = 0
        while pre[i][0] < n:  # a handful of types
            i += 1
        before_n, before_rate = (pre[i - 1][0], pre[i - 1][1]) if i else (0, 0.0)
        return i, before_rate + pool.rate[pool.types[i][0]] * (n - before_n)

    def lower_bound(self, pool: Pool, pp: int, dp: int) -> float:
        i, total_rate = self._upto(pool, pp * dp)
        _, _, max_k, max_speed, _, _ = self._prefix(pool)[i]
        c = self.costs
        n_layers = self.spec.num_layers
        if pool.fastest is None:  # per pool, not per shape: the fastest group's rate and LM head
            best_key = pool.types[0][0]
            pool.fastest = (pool.rate[best_key], c.extra_s(best_key[0], best_key[1], True, True),
                            c.extra_s(best_key[0], best_key[1], False, True))
        best_rate, head_alone, head_last = pool.fastest
        m = self.batch.microbatches
        spread = max(m - dp, 0) * n_layers / total_rate
        # the busiest replica runs ⌈M/dp⌉ micro-batches through at least ⌈L/pp⌉ layers of
        # its bottleneck stage, no stage being faster than the fastest group
        # (every stage of a pipeline also sends at least once per micro-batch: Costs.extra_s)
        send = c.hop_s() if pp > 1 else 0.0
        beyond, first = busiest_microbatches(m, dp, self._documents)
        busiest = beyond * (math.ceil(n_layers / pp) / best_rate + send)
        head = head_alone if pp == 1 else head_last  # the LM head runs somewhere (head_last: + its send)
        sends = c.hops_s(pp) - send  # all the pipeline's sends but the one already in head_last
        busiest = max(busiest, beyond * (n_layers / best_rate + head + sends) / pp)
        bound = max(spread, busiest) + first * c.beta * (n_layers / best_rate + head + sends)
        shard = n_layers * c.layer_params / (pp * max_k)
        bound += shard * self.config.memory.state_bytes_per_param * 2.0 / self.config.hbm_bw_Bps / max_speed
        if dp > 1:
            cl = self.cluster
            bound += 2.0 * (dp - 1) / dp * shard * self.config.grad_reduce_bytes / cl.inter_node_bw_Bps
            bound += 2.0 * (dp - 1) * cl.inter_node_latency_s
        return bound

    def fits(self, pool: Pool, pp: int, dp: int) -> bool:
        """Necessary memory condition: with every stage at its loosest cap (a middle stage,
        one micro-batch in flight) each selected group must still take its share of layers."""
        i, _ = self._upto(pool, pp * dp)
        _, _, _, _, min_cap, max_cap = self._prefix(pool)[i]
        return min_cap >= max(self.v, self.spec.num_layers - (pp - 1) * max_cap)

    def dp_candidates(self, pool: Pool, pp: int) -> list[int]:
        n = sum(c for _, c in pool.types)
        top = min(n // pp, self.batch.microbatches)
        if top < self.min_dp:
            return []
        if top <= 16:
            return list(range(self.min_dp, top + 1))
        best_rate = pool.rate[pool.types[0][0]]
        clean = sum(c for key, c in pool.types if pool.rate[key] >= best_rate * (1 - 1e-12)) // pp
        cands = {top, top - 1, top - 2, clean, clean - 1}
        divs = _divisors(self.batch.microbatches)
        cands.add(divs[bisect.bisect_right(divs, top) - 1])  # the largest divisor of the batch <= top
        return sorted(d for d in cands if self.min_dp <= d <= top)

    def arrange(self, pool: Pool, pp: int, dp: int, arrangement: str) -> list[tuple[list[StageKey], int]]:
        return arrange(self._selected(pool, pp * dp), pp, dp, arrangement)

    def _orders(self, keys: list[StageKey], rate: dict[StageKey, float]) -> list[PipeSig]:
        distinct = sorted(set(keys), key=lambda k: (-rate[k], k))
        if len(distinct) == 1:
            return [PipeSig(tuple(keys))]
        out: list[PipeSig] = []
        seen: set[tuple[StageKey, ...]] = set()
        # which types run the embedding and the LM head: the 4 fastest on small clusters;
        # on large ones (many pipelines, a few sick groups) the fastest two and the slowest
        ends = distinct[:4] if len(self.node_devs) <= self.MIXED_TP_MAX_NODES else sorted(
            set(distinct[:2] + distinct[-1:]), key=distinct.index)
        for first in ends:
            for last in ends:
                rest = list(keys)
                rest.remove(first)
                if last not in rest:
                    continue
                rest.remove(last)
                for middle in (sorted(rest, key=lambda k: (-rate[k], k)), sorted(rest, key=lambda k: (rate[k], k))):
                    seq = tuple([first] + middle + [last])
                    if seq not in seen:
                        seen.add(seq)
                        out.append(PipeSig(seq))
        return out

    def _shard(self, sig: PipeSig, layers: Sequence[int]) -> float:
        return largest_shard(self.costs, sig.stages, layers)

    def evaluate_shape(self, pool: Pool, pp: int, dp: int, arrangement: str, bound: float) -> ShapeResult | None:
        return self.evaluate_groups(pool, pp, dp, arrangement, self.arrange(pool, pp, dp, arrangement), bound)

    def improve_by_swaps(self, shape: ShapeResult, bound: float, rounds: int = 8) -> ShapeResult:
        """Hill-climb from an arranged shape: swap two groups of different types between two
        pipelines while that helps. The three arrangements miss layouts such as the weakest
        group between two strong ones beside a uniform pipeline, which matter once a middle
        stage pays two sends per micro-batch (small clusters only: large ones have many
        identical groups and few types)."""
        pipes = [list(sig.stages) for sig, count in shape.classes for _ in range(count)]
        if len(pipes) < 2 or len(pipes) > self.SWAP_MAX_PIPELINES:
            return shape
        best = shape
        seen: set[tuple[tuple[StageKey, ...], ...]] = {tuple(sorted(tuple(sorted(p)) for p in pipes))}
        budget = self.SWAP_BUDGET
        for _ in range(rounds):
            found = None
            for trial in swaps(pipes):
                ident = tuple(sorted(tuple(sorted(p)) for p in trial))
                if ident in seen:
                    continue
                seen.add(ident)
                budget -= 1
                if budget < 0:
                    break
                groups = [(list(keys), n) for keys, n in sorted(Counter(tuple(sorted(p)) for p in trial).items())]
                res = self.evaluate_groups(shape.pool, shape.pp, shape.dp, "swap", groups, bound)
                if res is not None and res.time_s < best.time_s * (1 - 1e-9):
                    best, found = res, trial
            if found is None:
                break
            pipes = found  # the best neighbour: climb from there
        return best

    def evaluate_groups(self, pool: Pool, pp: int, dp: int, arrangement: str,
                        groups: list[tuple[list[StageKey], int]], bound: float) -> ShapeResult | None:
        costs = self.costs
        m_total = self.batch.microbatches
        typical = max(1, math.ceil(m_total / dp))
        sigs: list[PipeSig] = []
        for keys, _ in groups:
            best: tuple[float, float, PipeSig] | None = None
            for sig in self._orders(keys, pool.rate):
                res = profile(costs, sig).best(typical)
                if res is None:
                    continue
                shard = self._shard(sig, res[1])  # ties: the smaller largest shard syncs faster
                if best is None or res[0] < best[0] * (1 - 1e-12) or (
                        res[0] <= best[0] * (1 + 1e-12) and shard < best[1]):
                    best = (res[0], shard, sig)
            sigs.append(best[2] if best is not None else self._orders(keys, pool.rate)[0])

        alloc = allocate_shares([profile(costs, s) for s in sigs], [c for _, c in groups], m_total, pp if self.v > 1 else 1)
        if alloc is None:
            return None
        makespan, shares = alloc
        if self._documents:
            # the chosen plan's batch is cut by the document (_choose): rank the shape by that
            # makespan, or a shape whose replicas split the batch unevenly (255 devices in
            # 31 replicas) loses to one that wastes devices but splits it evenly
            split = [(sig, tuple(got[1])) for sig in sigs if (got := profile(costs, sig).best(typical)) is not None]
            if len(split) == len(sigs):
                finer = document_makespan(costs, split, [c for _, c in groups], dp)
                if finer is not None:
                    makespan = min(makespan, finer)
        shards: list[tuple[int, int, bool, bool, float]] = []
        for sig, row in zip(sigs, shares):
            for m in sorted(set(row)):
                res = profile(costs, sig).best(max(m, 1))
                if res is None:
                    return None
                for s, (key, layers) in enumerate(zip(sig.stages, res[1])):
                    shards.append((key[0], layers, s == 0, s == pp - 1, key[1]))
        total = makespan + costs.sync_s(dp, shards, self.link)
        if self.link > 1.0 and pp > 1:  # the slow node's stage: its (at most two) edges
            busiest_m = max((max(row) for row in shares if row), default=1)
            total += costs.link_extra_s([self.link] * min(pp, 2) + [1.0] * (pp - min(pp, 2)), busiest_m)
        classes = [(sig, c) for sig, (_, c) in zip(sigs, groups)]
        return ShapeResult(total, pool, pp, dp, arrangement, classes, shares, bound)

    # --- the search -----------------------------------------------------------------------
    def _shape_key(self, keep: int) -> tuple[object, ...]:
        """What the shape search depends on: the multiset of node signatures (not which
        ranks), the model, batch, config, schedule and link constants."""
        counts = {sig: n for sig, (_, n) in self._sig_count.items()}
        c = self.cluster
        return (tuple(sorted(counts.items())), self.spec, self.batch, self.config, self.costs.schedule, self.v, keep,
                self.min_dp,
                c.intra_node_bw_Bps, c.inter_node_bw_Bps, c.intra_node_latency_s, c.inter_node_latency_s,
                c.device_flops, self.link)

    def search(self, keep: int = 3) -> SearchResult:
        key = self._shape_key(keep)
        hit = _SHAPES.get(key)
        if hit is None:
            try:
                hit = self._search_shapes(keep)
            except SpecError:
                if self.min_dp == 1:
                    raise
                self.min_dp = 1  # no layout with two replicas fits: one it is
                return self.search(keep)
            if len(_SHAPES) >= 64:
                _SHAPES.pop(next(iter(_SHAPES)))
            _SHAPES[key] = hit
        close, n_shapes, evaluated = hit
        return self._choose(close, n_shapes, evaluated)

    def _search_shapes(self, keep: int) -> tuple[list[ShapeResult], int, int]:
        """The best shapes (up to ``keep`` within the tolerance) as rank-free ShapeResults;
        identical node signatures give identical shapes, so callers share them (_SHAPES)."""
        n_layers = self.spec.num_layers
        pools: list[Pool] = []
        seen: set[object] = set()
        # mixed TP sizes (some nodes at tp/2) are explored on small clusters only, where
        # batch and layer granularity make them pay; large clusters have enough groups
        n_nodes = len(self.node_devs)
        mixes = [(0, 1)]
        if n_nodes <= self.MIXED_TP_MAX_NODES:
            mixes += [(r, 1) for r in range(1, n_nodes + 1)] + [(r, d) for r in (1, 2) for d in (2, 3)]
        # halving a slow device's group pays where groups are few (a handful of nodes); on
        # larger clusters it multiplies the pools (+40 % search time on 8 nodes) for little:
        # the other variants already shrink the group
        variants = VARIANTS if n_nodes <= self.HALVE_MAX_NODES else VARIANTS[:-1]
        for tp in legal_tp_sizes(self.spec, self.cluster, self.config):
            for variant in variants:
                for split, depth in mixes:
                    if split and tp >> depth < 1:
                        continue
                    pool = self.pool(tp, variant, split, depth)
                    if self.config.uniform_tp_per_layer and len({key[0] for key, _ in pool.types}) > 1:
                        continue  # a runtime that splits each layer one way cannot run mixed TP sizes
                    ident = tuple(pool.types)
                    if ident not in seen:
                        seen.add(ident)
                        pools.append(pool)
        shapes: list[tuple[float, int, int, int, int]] = []
        for pi, pool in enumerate(pools):
            for pp in range(1, n_layers // self.v + 1):
                for dp in self.dp_candidates(pool, pp):
                    if self.fits(pool, pp, dp):
                        shapes.append((self.lower_bound(pool, pp, dp), pi, pp, dp, len(shapes)))
        shapes.sort()
        results: list[ShapeResult] = []
        seeds: list[tuple[float, int, ShapeResult, float]] = []
        best = INF
        evaluated = 0
        for bound, pi, pp, dp, _ in shapes:
            if bound >= best * (1 + self.config.equal_speed_tolerance):
                break
            uniform = len(self._selected(pools[pi], pp * dp)) == 1  # one group type: arrangements coincide
            arrangements: tuple[str, ...] = ARRANGEMENTS[:1] if uniform else ARRANGEMENTS
            if len(self.node_devs) > self.MIXED_TP_MAX_NODES:
                arrangements = arrangements[:2]  # snake pairs matter only with few, uneven groups
            shape_best: ShapeResult | None = None
            for arrangement in arrangements:
                res = self.evaluate_shape(pools[pi], pp, dp, arrangement, bound)
                evaluated += 1
                if res is not None and res.time_s < INF:
                    results.append(res)
                    best = min(best, res.time_s)
                    if shape_best is None or res.time_s < shape_best.time_s:
                        shape_best = res
            if shape_best is not None and not uniform and len(self.node_devs) <= self.MIXED_TP_MAX_NODES:
                seeds.append((shape_best.time_s, len(seeds), shape_best, bound))
        # the most promising arranged shapes are improved by swapping groups (after the loop,
        # so that how many climb does not depend on the order the shapes came in)
        seeds.sort(key=lambda x: (x[0], x[1]))
        for time_s, _, seed, bound in seeds[:self.SWAP_SEEDS]:
            if time_s > best * (1 + self.SWAP_WITHIN):
                break
            res = self.improve_by_swaps(seed, bound)
            if res is not seed:
                results.append(res)
                best = min(best, res.time_s)
        if not results:
            raise SpecError(
                f"planner: no layout of {self.spec.name} fits the healthy devices "
                f"({sum(len(d) for d in self.node_devs)} devices): the model does not fit in memory at any "
                "TP × PP; add devices or memory, or use activation recomputation"
            )
        results.sort(key=lambda r: r.time_s)
        close: list[ShapeResult] = []
        idents: set[object] = set()
        for res in results:
            if res.time_s > best * (1 + self.config.equal_speed_tolerance) or len(close) >= keep:
                break
            shape_id: object = (res.pool.tp, res.pp, res.dp, tuple(res.classes), tuple(tuple(r) for r in res.shares))
            if shape_id not in idents:
                idents.add(shape_id)
                close.append(res)
        return close, len(shapes), evaluated

    def _choose(self, close: list[ShapeResult], n_shapes: int, evaluated: int) -> SearchResult:
        chosen: tuple[int, float, ShapeResult, tuple[list[PipelinePlan], tuple[int, ...]], Move | None] | None = None
        alternatives: list[tuple[float, int]] = []
        bw = self.cluster.inter_node_bw_Bps
        for res in close:
            parts = self._parts(res)
            move = None
            if self.current is not None:
                move = replicas_move(self.current, parts[0], self.spec, self.config.memory, bw)
            moved = move.bytes_total if move is not None else 0
            alternatives.append((res.time_s, moved if len(close) > 1 else 0))
            if chosen is None or (moved, res.time_s) < (chosen[0], chosen[1]):
                chosen = (moved, res.time_s, res, parts, move)
        assert chosen is not None
        moved, _, _, (replicas, spares), move = chosen
        epoch = self.current.epoch + 1 if self.current is not None else 0
        plan = Plan(tuple(replicas), self.costs.schedule, self.v, epoch, spares, "")
        if self.config.document_shares:
            plan = document_shares(self.costs, plan) or plan
        ev = evaluate_with(self.costs, plan)
        it = ev.iteration_s
        tps = self.batch.microbatches * self.costs.tokens / it
        return SearchResult(plan, it, tps, n_shapes, evaluated, moved, alternatives, move)


def search_plan(
    cluster: Cluster, model: ModelSpec, batch: GlobalBatch, current: Plan | None = None,
    config: PlannerConfig | None = None,
) -> Plan:
    """The best plan over the healthy devices (ties: the one moving the least state)."""
    return Searcher(cluster, model, batch, current, config or PlannerConfig()).search().plan
