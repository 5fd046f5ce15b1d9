"""Exhaustive reference planner for small clusters (the optimality check of bench/plan.py).

It enumerates every plan of the planner's space: per node every collection of disjoint
node-local TP groups of legal sizes, their union over nodes, every (pp, dp) that uses all
chosen groups, every partition of the groups into pipelines, every stage order, every
layer split (all compositions) and the exact min-max shares (dynamic programming) — whole
micro-batches, or, where the planner cuts shares by the packed document, every document
count per pipeline packed as the planner may pack it (the even split's micro-batch count, or
as few as the activation budget allows: planner.docshares). Devices
of equal speed and memory on one node are interchangeable, which keeps it finite. It is
branch-and-bound — a (groups, pp, dp) is skipped only when a valid lower bound on its time
exceeds the best found — so the answer is exact. Exponential: ≤ 16 devices only. Pure.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.cost import INF, Costs, PlannerConfig, StageKey, largest_shard
from resihp.coordinator.planner.docshares import busiest_microbatches, document_cap
from resihp.coordinator.planner.groups import legal_tp_sizes

DevKey = tuple[float, float]  # (speed, memory)


def _node_collections(devs: Counter[DevKey], sizes: Sequence[int]) -> set[tuple[StageKey, ...]]:
    """Every multiset of disjoint groups (as sorted group types) from a node's devices."""
    out: set[tuple[StageKey, ...]] = set()
    kinds = sorted(devs)

    def groups_of(k: int, avail: Counter[DevKey]) -> Iterator[Counter[DevKey]]:
        def rec(i: int, left: int, cur: Counter[DevKey]) -> Iterator[Counter[DevKey]]:
            if left == 0:
                yield Counter(cur)
                return
            if i == len(kinds):
                return
            for take in range(min(left, avail[kinds[i]]), -1, -1):
                if take:
                    cur[kinds[i]] = take
                yield from rec(i + 1, left - take, cur)
                cur.pop(kinds[i], None)
        yield from rec(0, k, Counter())

    def rec(avail: Counter[DevKey], chosen: list[StageKey], last: StageKey | None) -> None:
        out.add(tuple(sorted(chosen)))
        for k in sizes:
            for g in groups_of(k, avail):
                key = (k, min(s for s, _ in g), min(m for _, m in g))
                if last is not None and key < last:
                    continue  # canonical order: non-decreasing group types
                chosen.append(key)
                rec(avail - g, chosen, key)
                chosen.pop()

    rec(Counter(devs), [], None)
    return out


def _multiset_blocks(items: list[StageKey], size: int, count: int) -> Iterator[list[tuple[StageKey, ...]]]:
    """Partitions of a sorted multiset into ``count`` unordered blocks of ``size``."""
    if count == 0:
        if not items:
            yield []
        return
    first = items[0]
    rest = items[1:]
    seen: set[tuple[StageKey, ...]] = set()
    for combo in itertools.combinations(range(len(rest)), size - 1):
        block = (first,) + tuple(rest[i] for i in combo)
        if block in seen:
            continue
        seen.add(block)
        remaining = [x for i, x in enumerate(rest) if i not in combo]
        for tail in _multiset_blocks(remaining, size, count - 1):
            yield [block] + tail


def _compositions(total: int, parts: int, least: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if total >= least:
            yield (total,)
        return
    for x in range(least, total - least * (parts - 1) + 1):
        for tail in _compositions(total - x, parts - 1, least):
            yield (x,) + tail


class Exhaustive:
    def __init__(self, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, config: PlannerConfig,
                 costs: Costs) -> None:
        self.cluster, self.spec, self.batch, self.config, self.costs = cluster, spec, batch, config, costs
        self._cap_memo: dict[tuple[StageKey, int, int], np.ndarray] = {}
        self._block: dict[tuple[StageKey, ...], list[tuple[float, tuple[StageKey, ...], tuple[int, ...]]]] = {}
        # shares cut by the document: units are documents, and a block's time for d of them is
        # its best over orders, splits and micro-batch counts (planner.docshares)
        self.cap = document_cap(costs) if config.document_shares else None
        self.docs = batch.documents_per_microbatch if self.cap is not None else 1
        self._doc_block: dict[tuple[tuple[StageKey, ...], int], list[tuple[float, tuple[StageKey, ...], tuple[int, ...], int]]] = {}
        self.dp = 1  # of the shape being priced: sets the even split's micro-batch count

    def unit_time(self, block: tuple[StageKey, ...], units: int) -> tuple[float, tuple[StageKey, ...], tuple[int, ...], int]:
        """(time, order, layers, micro-batches) of one pipeline given ``units`` of the batch:
        micro-batches, or documents when shares are cut by the document."""
        if self.cap is None:
            t, order, comp = self.block_time(block, units)
            return t, order, comp, units
        key = (block, self.dp)
        table = self._doc_block.get(key)
        if table is None:
            table = self._doc_table(block)
            self._doc_block[key] = table
        return table[units]

    def _doc_table(self, block: tuple[StageKey, ...]) -> list[tuple[float, tuple[StageKey, ...], tuple[int, ...], int]]:
        costs = self.costs
        assert self.cap is not None
        n, cap = self.docs, self.cap
        p = len(block)
        d_max = self.batch.microbatches * n
        same = max(1, math.ceil(self.batch.microbatches / self.dp))
        comps = list(_compositions(self.spec.num_layers, p, 1))
        comp_arr = np.array(comps, dtype=np.float64)  # [C, p]
        orders = sorted(set(itertools.permutations(block)))
        out: list[tuple[float, tuple[StageKey, ...], tuple[int, ...], int]] = [(0.0, block, (), 0)]
        for d in range(1, d_max + 1):
            best: tuple[float, float, tuple[StageKey, ...], tuple[int, ...], int] = (INF, INF, block, (), 0)
            for m in sorted({max(1, math.ceil(d / (n * cap) - 1e-9)), same}):
                frac = d / (n * m)
                peak = max(frac, math.ceil(d / m - 1e-9) / n)
                if peak > cap + 1e-12:
                    continue
                for order in orders:
                    if frac == 1.0:  # Costs.pipeline_time's whole-micro-batch form
                        e = np.array([costs.extra_s(k, sp, s == 0, s == p - 1) for s, (k, sp, _) in enumerate(order)])
                        a = np.array([costs.per_layer_s(k, sp) for k, sp, _ in order])
                    else:
                        e = np.array([costs.stage_s(k, sp, 0, s == 0, s == p - 1, frac) for s, (k, sp, _) in enumerate(order)])
                        a = np.array([costs.stage_s(k, sp, 1, s == 0, s == p - 1, frac) for s, (k, sp, _) in enumerate(order)]) - e
                    caps = np.array([costs.layer_cap(key, s == 0, s == p - 1, costs.inflight(p, s, m) * peak)
                                     for s, key in enumerate(order)])
                    times = e[None, :] + comp_arr * a[None, :]
                    t = np.where((comp_arr <= caps[None, :]).all(axis=1),
                                 (m - 1) * times.max(axis=1) + costs.beta * times.sum(axis=1), np.inf)
                    ci = int(np.argmin(t))
                    if t[ci] == INF:
                        continue
                    shard = largest_shard(costs, order, comps[ci])
                    if t[ci] < best[0] * (1 - 1e-12) or (t[ci] <= best[0] * (1 + 1e-12) and shard < best[1]):
                        best = (float(t[ci]), shard, order, comps[ci], m)
            out.append((best[0], best[2], best[3], best[4]))
        return out

    def block_time(self, block: tuple[StageKey, ...], m: int) -> tuple[float, tuple[StageKey, ...], tuple[int, ...]]:
        """Best (time, stage order, layers) of one pipeline over every order and split; ties
        go to the split with the smallest largest shard (it shortens the DP all-reduce)."""
        table = self._block.get(block)
        if table is None:
            table = self._table(block)
            self._block[block] = table
        return table[m]

    def _caps(self, key: StageKey, s: int, p: int) -> np.ndarray:
        """Layer cap of a stage of type ``key`` at position s of p, for m = 1..M."""
        ck = (key, s, p)
        hit = self._cap_memo.get(ck)
        if hit is None:
            costs = self.costs
            hit = np.array([costs.layer_cap(key, s == 0, s == p - 1, costs.inflight(p, s, m))
                            for m in range(1, self.batch.microbatches + 1)], dtype=np.float64)
            self._cap_memo[ck] = hit
        return hit

    def _table(self, block: tuple[StageKey, ...]) -> list[tuple[float, tuple[StageKey, ...], tuple[int, ...]]]:
        costs = self.costs
        v = costs.v
        p = len(block)
        m_max = self.batch.microbatches
        comps = list(_compositions(self.spec.num_layers, p, v))
        orders = sorted(set(itertools.permutations(block)))
        comp_arr = np.array(comps, dtype=np.float64)  # [C, p]
        peaks: list[np.ndarray] = []
        totals: list[np.ndarray] = []
        shards: list[np.ndarray] = []
        feas: list[np.ndarray] = []
        who: list[tuple[int, int]] = []
        for oi, order in enumerate(orders):
            a = np.array([costs.per_layer_s(k, sp) for k, sp, _ in order])
            e = np.array([costs.extra_s(k, sp, s == 0, s == p - 1) for s, (k, sp, _) in enumerate(order)])
            times = e[None, :] + comp_arr * a[None, :]
            fixed = np.array([(costs.emb_params if s == 0 else 0) + (costs.emb_params if s == p - 1 else 0)
                              for s in range(p)], dtype=np.float64)
            power = np.array([k * sp for k, sp, _ in order])
            shard = ((comp_arr * costs.layer_params + fixed[None, :]) / power[None, :]).max(axis=1)
            caps = np.stack([self._caps(key, s, p) for s, key in enumerate(order)], axis=1)  # [M, p]
            ok = np.asarray((comp_arr[None, :, :] <= caps[:, None, :]).all(axis=2))  # [M, C]
            peaks.append(times.max(axis=1))
            totals.append(times.sum(axis=1))
            shards.append(shard)
            feas.append(ok)
            who.extend((oi, ci) for ci in range(len(comps)))
        peak = np.concatenate(peaks)
        total = np.concatenate(totals)
        shard_all = np.concatenate(shards)
        ok_all = np.concatenate(feas, axis=1)  # [M, O*C]
        out: list[tuple[float, tuple[StageKey, ...], tuple[int, ...]]] = [(INF, block, ())] * (m_max + 1)
        for m in range(1, m_max + 1):
            t = np.where(ok_all[m - 1], (m - 1) * peak + costs.beta * total, np.inf)  # sends: in e
            tmin = float(t.min())
            if tmin == INF:
                continue
            near = np.flatnonzero(t <= tmin * (1 + 1e-12))
            pick = int(near[np.argmin(shard_all[near])])
            oi, ci = who[pick]
            out[m] = (float(t[pick]), orders[oi], comps[ci])
        out[0] = (0.0 if out[1][0] < INF else INF, out[1][1], out[1][2])
        return out

    def run(self) -> tuple[float, Plan] | None:
        sizes = legal_tp_sizes(self.spec, self.cluster, self.config)
        per_node = []
        node_ranks: list[dict[DevKey, list[int]]] = []
        for devs in self.cluster.nodes().values():
            alive = [d for d in devs if not d.failed]
            if not alive:
                continue
            cnt: Counter[DevKey] = Counter((d.speed, float(d.memory_bytes)) for d in alive)
            per_node.append(sorted(_node_collections(cnt, sizes)))
            ranks: dict[DevKey, list[int]] = {}
            for d in alive:
                ranks.setdefault((d.speed, float(d.memory_bytes)), []).append(d.rank)
            node_ranks.append(ranks)
        if not per_node:
            raise SpecError("exhaustive: no healthy device")
        m_total = self.batch.microbatches
        n_layers = self.spec.num_layers
        best: tuple[float, list[tuple[tuple[StageKey, ...], tuple[int, ...], int, int]], tuple[tuple[StageKey, ...], ...]] | None = None
        # combine nodes one at a time, merging node-wise choices that give the same multiset
        # of group types (node identity does not change a plan's time)
        combos: dict[tuple[StageKey, ...], tuple[tuple[StageKey, ...], ...]] = {(): ()}
        for colls in per_node:
            nxt: dict[tuple[StageKey, ...], tuple[tuple[StageKey, ...], ...]] = {}
            for have, choice in combos.items():
                for coll in colls:
                    merged = tuple(sorted(have + coll))
                    if merged not in nxt:
                        nxt[merged] = choice + (coll,)
            combos = nxt
        work: list[tuple[float, tuple[tuple[StageKey, ...], ...], int, int, list[StageKey]]] = []
        for merged, choice in combos.items():
            items = list(merged)
            n = len(items)
            for pp in range(1, n_layers // self.costs.v + 1):
                if n % pp or n == 0:
                    continue
                dp = n // pp
                if dp > m_total:
                    continue
                rate = sorted((1.0 / self.costs.per_layer_s(k[0], k[1]) for k in items), reverse=True)
                # every stage of a pipeline sends at least once per micro-batch
                send = self.costs.hop_s() if pp > 1 else 0.0
                beyond, first = busiest_microbatches(m_total, dp, self.cap is not None)  # as Searcher.lower_bound
                busiest = beyond * (-(-n_layers // pp) / rate[0] + send)
                lb = (max(max(m_total - dp, 0) * n_layers / sum(rate), busiest)
                      + first * self.costs.beta * (n_layers / rate[0] + self.costs.hops_s(pp)))
                work.append((lb, choice, pp, dp, items))
        work.sort(key=lambda w: (w[0], w[2], w[3]))
        for lb, choice, pp, dp, items in work:
            if best is not None and lb >= best[0]:
                break
            self.dp = dp
            for blocks in _multiset_blocks(items, pp, dp):
                res = self._shares(blocks)
                if res is None:
                    continue
                makespan, alloc = res
                shards: list[tuple[int, int, bool, bool, float]] = []
                chosen = []
                for block, u in zip(blocks, alloc):
                    _, order, comp, m = self.unit_time(block, max(u, 1))
                    for s, (k, comp_s) in enumerate(zip(order, comp)):
                        shards.append((k[0], comp_s, s == 0, s == pp - 1, k[1]))
                    chosen.append((order, comp, m if u else 0, u))
                total = makespan + self.costs.sync_s(dp, shards)
                if best is None or total < best[0] - 1e-15:
                    best = (total, chosen, choice)
        if best is None:
            return None
        return best[0], self._materialise(best[1], best[2], node_ranks)

    def _shares(self, blocks: list[tuple[StageKey, ...]]) -> tuple[float, list[int]] | None:
        m_total = self.batch.microbatches * self.docs
        unit = len(blocks[0]) if self.costs.v > 1 else 1
        if m_total % unit:
            return None
        units = m_total // unit
        # f[j] = best makespan of the blocks so far using j units; exact DP over shares
        f: list[float] = [0.0] + [INF] * units
        arg: list[list[int]] = []
        for block in blocks:
            g = [INF] * (units + 1)
            a = [0] * (units + 1)
            for used in range(units + 1):
                if f[used] == INF:
                    continue
                for x in range(units - used + 1):
                    t = max(f[used], self.unit_time(block, x * unit)[0])
                    if t < g[used + x] - 1e-15:
                        g[used + x] = t
                        a[used + x] = x
            arg.append(a)
            f = g
        if f[units] == INF:
            return None
        alloc = []
        j = units
        for a in reversed(arg):
            alloc.append(a[j] * unit)
            j -= a[j]
        alloc.reverse()
        return f[units], alloc

    def _materialise(self, chosen: list[tuple[tuple[StageKey, ...], tuple[int, ...], int, int]],
                     choice: tuple[tuple[StageKey, ...], ...], node_ranks: list[dict[DevKey, list[int]]]) -> Plan:
        # concrete groups per type: take devices of the right kinds from the node
        pools: dict[StageKey, list[tuple[int, ...]]] = {}
        for coll, ranks in zip(choice, node_ranks):
            free = {kind: list(rs) for kind, rs in ranks.items()}
            for k, speed, mem in sorted(coll, key=lambda t: (-t[1], -t[2], t[0])):
                # the slowest member sets the type; fill with the slowest devices that qualify,
                # keeping fast ones for groups that need them (groups with a faster minimum go first)
                members = [free[(speed, mem)].pop(0)]
                for kind in sorted(free):
                    while len(members) < k and free[kind] and kind[0] >= speed and kind[1] >= mem:
                        members.append(free[kind].pop(0))
                pools.setdefault((k, speed, mem), []).append(tuple(sorted(members)))
        replicas = []
        used: set[int] = set()
        b = self.batch.tokens_per_microbatch
        tokens = [u * b // self.docs if self.cap is not None else 0 for *_, u in chosen]
        if self.cap is not None:  # integer rounding, as planner.docshares
            tokens[max(range(len(chosen)), key=lambda i: chosen[i][3])] += self.batch.microbatches * b - sum(tokens)
        for (order, comp, m, _), tok in zip(chosen, tokens):
            stages = []
            for key in order:
                g = pools[key].pop(0)
                used.update(g)
                stages.append(g)
            v = self.costs.v
            layers = comp
            if v > 1:
                per = [[c // v + (1 if i < c % v else 0) for i in range(v)] for c in comp]
                layers = tuple(per[j % len(comp)][j // len(comp)] for j in range(len(comp) * v))
            replicas.append(PipelinePlan(tuple(stages), layers, m, tok))
        spares = tuple(sorted(d.rank for d in self.cluster.healthy() if d.rank not in used))
        return Plan(tuple(replicas), self.costs.schedule, self.costs.v, 0, spares, "exhaustive")
