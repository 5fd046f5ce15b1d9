"""How much model and optimizer state a change of plan moves, and how long that takes.

Every rank of the new plan needs, for each layer it runs, its TP slice ``[j/k, (j+1)/k)`` of
that layer's weights and optimizer state (the embedding counts as layer −1 on the first
stage, the LM head as layer L on the last). Whatever of that slice it did not already hold
under the old plan must arrive over the network. Ranks receive in parallel, so the move
takes the largest per-rank inflow over the inter-node link. Gradients are not moved (zero
at a step boundary). Pure.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resihp.coordinator.model.memory import MemoryModel
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec


@dataclass(frozen=True)
class Move:
    bytes_total: int
    bytes_max_rank: int
    seconds: float


Holding = tuple[tuple[tuple[int, int], ...], int, int]  # (layer ranges incl. pseudo-layers, tp index, tp size)


_HOLDINGS: dict[int, tuple[Plan, int, dict[int, Holding]]] = {}  # id(plan) -> (plan kept alive, layers, result)


def holdings(plan: Plan, num_layers: int) -> dict[int, Holding]:
    """Per rank what it holds under ``plan``; memoised per plan object (plans are frozen, and
    decide compares the same current plan against every candidate)."""
    hit = _HOLDINGS.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] == num_layers:
        return hit[2]
    out = _holdings_of(plan.replicas, num_layers)
    if len(_HOLDINGS) >= 8:
        _HOLDINGS.clear()
    _HOLDINGS[id(plan)] = (plan, num_layers, out)
    return out


_SAME: dict[int, tuple[Plan, int, set[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]]]] = {}
_GROUPS: dict[int, tuple[Plan, int, dict[tuple[int, ...], tuple[tuple[int, int], ...]]]] = {}


def _group_holdings(plan: Plan, num_layers: int) -> dict[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """TP group -> the layer ranges it holds under ``plan``; memoised per plan object."""
    hit = _GROUPS.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] == num_layers:
        return hit[2]
    out: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
    memo: dict[tuple[tuple[int, ...], int], list[tuple[tuple[int, int], ...]]] = {}
    for rep in plan.replicas:
        per_stage = memo.get((rep.layers, rep.pp))
        if per_stage is None:  # replicas with one split share the range tuples (compared by identity)
            ranges = rep.layer_ranges()
            per_stage = memo[(rep.layers, rep.pp)] = [_stage_ranges(ranges, rep.pp, s, num_layers) for s in range(rep.pp)]
        for s, group in enumerate(rep.stages):
            out[group] = per_stage[s]
    if len(_GROUPS) >= 8:
        _GROUPS.clear()
    _GROUPS[id(plan)] = (plan, num_layers, out)
    return out


def _holdings_of(replicas: Sequence[PipelinePlan], num_layers: int) -> dict[int, Holding]:
    out: dict[int, Holding] = {}
    memo: dict[tuple[tuple[int, int], ...], list[tuple[tuple[int, int], ...]]] = {}
    for rep in replicas:
        ranges = rep.layer_ranges()
        p = rep.pp
        per_stage = memo.get(ranges)
        if per_stage is None or len(per_stage) != p:
            per_stage = memo[ranges] = [_stage_ranges(ranges, p, s, num_layers) for s in range(p)]
        for s, group in enumerate(rep.stages):
            held = per_stage[s]
            k = len(group)
            for t, rank in enumerate(group):
                out[rank] = (held, t, k)
    return out


def _stage_ranges(ranges: tuple[tuple[int, int], ...], p: int, s: int, num_layers: int) -> tuple[tuple[int, int], ...]:
    mine = list(ranges[s::p])
    if s == 0:
        mine.insert(0, (-1, 0))
    if s == p - 1:
        mine.append((num_layers, num_layers + 1))
    return tuple(mine)


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...], num_layers: int) -> tuple[int, int]:
    """(shared transformer layers, shared pseudo-layers) of two range lists."""
    layers = pseudo = 0
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            for edge in (-1, num_layers):
                if lo <= edge < hi:
                    pseudo += 1
                    if edge == -1:
                        lo += 1
                    else:
                        hi -= 1
            layers += max(0, hi - lo)
    return layers, pseudo


def _count(ranges: tuple[tuple[int, int], ...], num_layers: int) -> tuple[int, int]:
    return _overlap(ranges, ranges, num_layers)


def _inflow(ranges: tuple[tuple[int, int], ...], t: int, k: int, had: Holding | None, n: int, per_layer: float,
            per_emb: float, memo: dict[tuple[object, ...], tuple[int, int]]) -> float:
    if had == (ranges, t, k):
        return 0.0
    need = memo.get((ranges,))
    if need is None:
        need = memo[(ranges,)] = _count(ranges, n)
    need_l, need_p = need
    keep_l = keep_p = 0.0
    if had is not None:
        frac = max(0.0, min((t + 1) / k, (had[1] + 1) / had[2]) - max(t / k, had[1] / had[2]))
        shared = memo.get((ranges, had[0]))
        if shared is None:
            shared = memo[(ranges, had[0])] = _overlap(ranges, had[0], n)
        keep_l, keep_p = shared[0] * frac, shared[1] * frac
    return (need_l / k - keep_l) * per_layer + (need_p / k - keep_p) * per_emb


def plan_move(old: Plan, new: Plan, spec: ModelSpec, mem: MemoryModel, bandwidth_Bps: float) -> Move:
    """Bytes the new plan's ranks must receive; time at ``bandwidth_Bps`` per receiving rank."""
    return replicas_move(old, new.replicas, spec, mem, bandwidth_Bps)


def replicas_move(old: Plan, new: Sequence[PipelinePlan], spec: ModelSpec, mem: MemoryModel,
                  bandwidth_Bps: float) -> Move:
    """``plan_move`` to a layout given by its replicas (no Plan needs building)."""
    n = spec.num_layers
    before = holdings(old, n)
    old_held = _group_holdings(old, n)
    same = _SAME[id(old)][2] if id(old) in _SAME and _SAME[id(old)][0] is old else None
    if same is None:
        same = {(rep.stages, rep.layers) for rep in old.replicas}
        if len(_SAME) >= 8:
            _SAME.clear()
        _SAME[id(old)] = (old, n, same)
    per_layer = spec.params_per_layer() * mem.moved_bytes_per_param
    per_emb = spec.embedding_params() * mem.moved_bytes_per_param
    total = 0.0
    worst = 0.0
    memo: dict[tuple[object, ...], tuple[int, int]] = {}  # symmetric ranks share range pairs
    flows: dict[tuple[int, int, int, int, int, int], float] = {}  # by identity of the shared range tuples
    stage_memo: dict[tuple[tuple[int, ...], int], list[tuple[tuple[int, int], ...]]] = {}
    group_flows: dict[tuple[int, int], tuple[list[float], float]] = {}  # by identity of both range tuples
    get = before.get
    for rep in new:
        if (rep.stages, rep.layers) in same:
            continue  # a replica kept with the same groups and split holds what it held: nothing moves
        p = rep.pp
        per_stage = stage_memo.get((rep.layers, p))
        if per_stage is None:
            ranges = rep.layer_ranges()
            per_stage = stage_memo[(rep.layers, p)] = [_stage_ranges(ranges, p, s, n) for s in range(p)]
        for s, group in enumerate(rep.stages):
            held = per_stage[s]
            prior = old_held.get(group)
            if prior == held:
                continue  # the same TP group ran the same layers before: each member keeps its slice
            k = len(group)
            hid = id(held)
            if prior is not None:  # the same TP group, other layers: member t held slice t of ``prior``
                gkey = (hid, id(prior))  # range tuples are shared per split (_group_holdings)
                got = group_flows.get(gkey)
                if got is None:
                    flows_t = [_inflow(held, t, k, (prior, t, k), n, per_layer, per_emb, memo) for t in range(k)]
                    got = group_flows[gkey] = (flows_t, max(flows_t))
                for f in got[0]:  # rank by rank, as the general path adds them
                    total += f
                if got[1] > worst:
                    worst = got[1]
                continue
            for t, rank in enumerate(group):
                had = get(rank)
                fkey = (hid, t, k, -1, -1, -1) if had is None else (hid, t, k, id(had[0]), had[1], had[2])
                inflow = flows.get(fkey)
                if inflow is None:
                    inflow = flows[fkey] = _inflow(held, t, k, had, n, per_layer, per_emb, memo)
                total += inflow
                if inflow > worst:
                    worst = inflow
    return Move(int(total), int(worst), worst / bandwidth_Bps)
