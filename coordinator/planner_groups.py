"""TP groups and the search's value types: how a node's devices are cut into TP groups
(power-of-two prefixes, ResiHP's TP exclusion variants), per-cluster node tables cached for
16K-device clusters, and the pools / shapes / results the joint search (planner_search)
passes around. Pure and deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from operator import attrgetter
from typing import Mapping, Sequence

from resihp.coordinator.cluster import Cluster, DeviceState
from resihp.coordinator.plan import Plan
from resihp.coordinator.planner_cost import PipeSig, PlannerConfig, StageKey
from resihp.coordinator.planner_move import Move
from resihp.coordinator.spec import ModelSpec


def pow2_pieces(n: int) -> list[int]:
    out = []
    bit = 1 << max(0, n.bit_length() - 1)
    while n > 0:
        if bit <= n:
            out.append(bit)
            n -= bit
        bit >>= 1
    return out


_NODES: dict[int, tuple[Cluster, dict[str, list[DeviceState]]]] = {}
# (ranks, nodes) of the last cluster grouped and its node boundaries: clusters derived from
# one another (a finding applied) keep that structure, so grouping them is a comparison
_LAYOUT: list[tuple[list[int], list[object], list[tuple[str, int, int]]]] = []


_RANK = attrgetter("rank")
_NODE = attrgetter("node")


@lru_cache(maxsize=16)
def _divisors(m: int) -> list[int]:
    return [d for d in range(1, m + 1) if m % d == 0]


def cluster_nodes(cluster: Cluster) -> dict[str, list[DeviceState]]:
    """``cluster.nodes()``, memoised per cluster object (clusters are frozen; one decision
    asks several times, and at 16K devices each answer sorts them all). Do not mutate."""
    hit = _NODES.get(id(cluster))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    devs = cluster.devices
    ranks = list(map(_RANK, devs))
    nodes = list(map(_NODE, devs))
    if _LAYOUT and _LAYOUT[0][0] == ranks and _LAYOUT[0][1] == nodes:
        out = {key: list(devs[a:b]) for key, a, b in _LAYOUT[0][2]}
    else:
        if any(a > b for a, b in zip(ranks, ranks[1:])):
            devs = tuple(sorted(devs, key=_RANK))
        # what Cluster.nodes() returns (devices per str(node), in rank order), in one pass
        out = {}
        last: object = None
        bucket: list[DeviceState] = []
        for d in devs:
            if last is None or d.node != last:
                last = d.node
                bucket = out.setdefault(str(last), [])
            bucket.append(d)
        contiguous = devs is cluster.devices and sum(1 for a, b in zip(nodes, nodes[1:]) if a != b) + 1 == len(out)
        if contiguous:  # each node's devices are one run of the rank order: remember the runs
            bounds = []
            start = 0
            for key, lst in out.items():
                bounds.append((key, start, start + len(lst)))
                start += len(lst)
            _LAYOUT[:] = [(ranks, nodes, bounds)]
    if len(_NODES) >= 8:
        _NODES.clear()
    _NODES[id(cluster)] = (cluster, out)
    return out


_NO_POSITIONS: Mapping[int, tuple[int, ...]] = {}
# (id(plan positions), ids of a node's devices) -> (positions, devices, alive devices in
# search order, their signature): most nodes are unchanged between decisions
_NODE_ORDER: dict[tuple[int, ...], tuple[Mapping[int, tuple[int, ...]], list[DeviceState], list[DeviceState],
                                         tuple[tuple[float, float], ...]]] = {}


def _order_node(devs: list[DeviceState], pos: Mapping[int, tuple[int, ...]]
                ) -> tuple[list[DeviceState], tuple[tuple[float, float], ...]]:
    """A node's healthy devices sorted by speed, memory, then current position, and their
    (speed, memory) signature."""
    far = (1 << 30, 0, 0)
    get = pos.get
    alive = [d for d in devs if not d.failed]
    if not alive:
        return alive, ()
    first = alive[0]
    if len({(d.speed, d.memory_bytes) for d in alive}) == 1:
        # one speed and memory (the common, healthy node): the order is by position,
        # and rank order already is that order unless the plan placed them otherwise
        keys = [(get(d.rank, far), d.rank) for d in alive]
        if keys != sorted(keys):
            alive.sort(key=lambda d: (get(d.rank, far), d.rank))
        return alive, ((first.speed, float(first.memory_bytes)),) * len(alive)
    alive.sort(key=lambda d: (-d.speed, -d.memory_bytes, get(d.rank, far), d.rank))
    return alive, tuple((d.speed, float(d.memory_bytes)) for d in alive)


def legal_tp_sizes(spec: ModelSpec, cluster: Cluster, config: PlannerConfig) -> list[int]:
    per_node = max(len([d for d in devs if not d.failed]) for devs in cluster_nodes(cluster).values())
    limit = per_node if config.max_tp == 0 else min(per_node, config.max_tp)
    out = []
    k = 1
    while k <= limit:
        if spec.num_heads % k == 0:
            out.append(k)
        k *= 2
    return out


def _form(speeds: Sequence[float], lo: int, hi: int, variant: str) -> list[tuple[int, int]]:
    """Groups (as [start, end) index ranges into the speed-sorted devices) for the chunk
    [lo, hi) whose length is a power of two."""
    size = hi - lo
    if variant == "keep" or size == 1 or speeds[hi - 1] >= speeds[lo]:
        return [(lo, hi)]
    best_k, best_v = size, size * speeds[hi - 1]
    k = size // 2
    while k >= 1:
        value = k * speeds[lo + k - 1]
        if value > best_v + 1e-12 or (variant == "exclude" and value >= best_v - 1e-12):
            best_k, best_v = k, value
        k //= 2
    if best_k == size:
        return [(lo, hi)]
    out = [(lo, lo + best_k)]
    start = lo + best_k
    for piece in pow2_pieces(hi - start):
        out.extend(_form(speeds, start, start + piece, variant))
        start += piece
    return out


def node_ranges(speeds: Sequence[float], tp: int, variant: str) -> list[tuple[int, int]]:
    """Groups of a node's speed-sorted devices. When the count is not a multiple of tp the
    remainder forms smaller power-of-two groups, from the slowest devices or — variants
    ending in "-lead" — from the fastest (then the slow devices pair up among themselves)."""
    base, _, lead = variant.partition("-")
    n = len(speeds)
    full, rest = divmod(n, tp)
    pieces = [tp] * full + pow2_pieces(rest)
    if lead and rest:
        pieces = pow2_pieces(rest) + [tp] * full
    out: list[tuple[int, int]] = []
    start = 0
    for piece in pieces:
        out.extend(_form(speeds, start, start + piece, base))
        start += piece
    return out


@dataclass
class Pool:
    """The TP groups of one (tp, variant), as types with counts."""

    tp: int
    variant: str
    types: list[tuple[StageKey, int]]  # sorted fastest (highest layer rate) first
    rate: dict[StageKey, float]
    split: int = 0  # this many nodes (the weakest) form groups of tp >> depth instead: mixed-TP layouts
    depth: int = 1
    prefix: list[tuple[int, float, int, float, int, int]] | None = None  # see Searcher._prefix
    fastest: tuple[float, float, float] | None = None  # see Searcher.lower_bound


@dataclass
class ShapeResult:
    time_s: float
    pool: Pool
    pp: int
    dp: int
    arrangement: str
    classes: list[tuple[PipeSig, int]]
    shares: list[list[int]]
    lower_bound: float


@dataclass
class SearchResult:
    plan: Plan
    iteration_s: float
    tokens_per_s: float
    shapes_bounded: int
    shapes_evaluated: int
    move_bytes: int = 0
    alternatives: list[tuple[float, int]] = field(default_factory=list)  # (iteration_s, move bytes) considered
    move: Move | None = None  # from the current plan (None without one)
