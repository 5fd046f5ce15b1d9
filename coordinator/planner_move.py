"""How much model and optimizer state a change of plan moves, and how long that takes.

Every rank of the new plan needs, for each layer it runs, its TP slice ``[j/k, (j+1)/k)`` of
that layer's weights and optimizer state (the embedding counts as layer −1 on the first
stage, the LM head as layer L on the last). Whatever of that slice it did not already hold
under the old plan must arrive over the network. Ranks receive in parallel, so the move
takes the largest per-rank inflow over the inter-node link. Gradients are not moved (zero
at a step boundary). Pure.
"""
from __future__ import annotations

from dataclasses import dataclass

from resihp.coordinator.memory import MemoryModel
from resihp.coordinator.plan import Plan
from resihp.coordinator.spec import ModelSpec



@dataclass(frozen=True)
class Move:
    bytes_total: int
    bytes_max_rank: int
    seconds: float


Holding = tuple[tuple[tuple[int, int], ...], int, int]  # (layer ranges incl. pseudo-layers, tp index, tp size)


def holdings(plan: Plan, num_layers: int) -> dict[int, Holding]:
    out: dict[int, Holding] = {}
    for rep in plan.replicas:
        ranges = rep.layer_ranges()
        p = rep.pp
        for s, group in enumerate(rep.stages):
            mine = [r for j, r in enumerate(ranges) if j % p == s]
            if s == 0:
                mine.insert(0, (-1, 0))
            if s == p - 1:
                mine.append((num_layers, num_layers + 1))
            held = tuple(mine)
            k = len(group)
            for t, rank in enumerate(group):
                out[rank] = (held, t, k)
    return out


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


def plan_move(old: Plan, new: Plan, spec: ModelSpec, mem: MemoryModel, bandwidth_Bps: float) -> Move:
    """Bytes the new plan's ranks must receive; time at ``bandwidth_Bps`` per receiving rank."""
    n = spec.num_layers
    before = holdings(old, n)
    after = holdings(new, n)
    per_layer = spec.params_per_layer() * mem.moved_bytes_per_param
    per_emb = spec.embedding_params() * mem.moved_bytes_per_param
    total = 0.0
    worst = 0.0
    memo: dict[tuple[object, ...], tuple[int, int]] = {}  # symmetric ranks share range pairs
    for rank, (ranges, t, k) in after.items():
        had = before.get(rank)
        if had == (ranges, t, k):
            continue
        need = memo.get((ranges,))
        if need is None:
            need = memo[(ranges,)] = _count(ranges, n)
        need_l, need_p = need
        frac_new = (t / k, (t + 1) / k)
        keep_l = keep_p = 0.0
        if had is not None:
            frac = max(0.0, min(frac_new[1], (had[1] + 1) / had[2]) - max(frac_new[0], had[1] / had[2]))
            shared = memo.get((ranges, had[0]))
            if shared is None:
                shared = memo[(ranges, had[0])] = _overlap(ranges, had[0], n)
            shared_l, shared_p = shared
            keep_l, keep_p = shared_l * frac, shared_p * frac
        inflow = (need_l / k - keep_l) * per_layer + (need_p / k - keep_p) * per_emb
        total += inflow
        worst = max(worst, inflow)
    return Move(int(total), int(worst), worst / bandwidth_Bps)
