"""TP groups and the search's value types: how a node's devices are cut into TP groups
(power-of-two prefixes, ResiHP's TP exclusion variants), per-cluster node tables cached for
16K-device clusters, and the pools / shapes / results the joint search (planner.search)
passes around. Pure and deterministic.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not

from resihp.coordinator.model.cluster import Cluster, DeviceState
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.planner.cost import PipeSig, PlannerConfig, StageKey
from resihp.coordinator.planner.move import Move


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


NodeSig = tuple[tuple[float, float], ...]
# one object per distinct node signature, so that per-node memos can key on its identity
_SIG_OBJECTS: dict[NodeSig, NodeSig] = {}
# the last node order computed: (devices, positions, each node's [start, end) in the
# devices, each node's (alive devices in search order, signature)); set when every node is
# one run of the device order
_LAST_ORDER: list[tuple[tuple[DeviceState, ...], Mapping[int, tuple[int, ...]], list[tuple[int, int]],
                        list[tuple[list[DeviceState], NodeSig]]]] = []
_SAME_PLACE = attrgetter("rank", "node")
# ids of a node's devices, all alive ones of one speed and memory -> (those devices, the
# alive ones in their last order, its signature, their ranks in that order)
_UNIFORM: dict[tuple[int, ...], tuple[list[DeviceState], list[DeviceState], NodeSig, tuple[int, ...]]] = {}


def node_order(cluster: Cluster, pos: Mapping[int, tuple[int, ...]]) -> list[tuple[list[DeviceState], NodeSig]]:
    """Per node (in ``cluster_nodes`` order): its healthy devices sorted by speed, memory,
    then position in ``pos``, and their (speed, memory) signature (one object per distinct
    signature). Do not mutate. A cluster that differs from the last one by a few devices
    (same ranks on the same nodes) under the same positions reorders only their nodes."""
    devs = cluster.devices
    if _LAST_ORDER and _LAST_ORDER[0][1] is pos and len(_LAST_ORDER[0][0]) == len(devs):
        old, _, bounds, entries = _LAST_ORDER[0]
        changed = list(compress(range(len(devs)), map(is_not, old, devs)))
        if len(changed) <= max(64, len(devs) // 16) and all(
                _SAME_PLACE(old[i]) == _SAME_PLACE(devs[i]) and type(old[i].node) is type(devs[i].node)
                for i in changed):
            entries = list(entries)
            starts = [a for a, _ in bounds]
            for j in sorted({bisect_right(starts, i) - 1 for i in changed}):
                a, b = bounds[j]
                entries[j] = _interned(_order_node(list(devs[a:b]), pos))
            _LAST_ORDER[:] = [(devs, pos, bounds, entries)]
            return entries
    memo = _NODE_ORDER
    if len(memo) > 50_000:
        memo.clear()
    if len(_UNIFORM) > 50_000:
        _UNIFORM.clear()
    pid = id(pos)
    get = pos.get
    far = (1 << 30, 0, 0)
    entries = []
    node_lists = list(cluster_nodes(cluster).values())
    for node_devs in node_lists:
        ids = tuple(map(id, node_devs))
        # a node of one speed and memory (most of them) is ordered by (position, rank): its
        # last order stands if still sorted under these positions (the list object is kept,
        # and the memos on it: its groups depend on that order only)
        prev = _UNIFORM.get(ids)
        if prev is not None:
            keys = list(zip(map(get, prev[3], repeat(far)), prev[3]))
            if keys == sorted(keys):
                entries.append((prev[1], prev[2]))
                continue
        key = (pid, *ids)  # the same device objects under the same plan order alike
        entry = memo.get(key)
        if entry is None or entry[0] is not pos:
            alive, sig = _interned(_order_node(node_devs, pos))
            if len(set(sig)) == 1:
                _UNIFORM[ids] = (node_devs, alive, sig, tuple(map(_RANK, alive)))
            entry = memo[key] = (pos, node_devs, alive, sig)
        entries.append((entry[2], entry[3]))
    # remember it for derived clusters when each node is one run of the device order
    if all(map(is_, chain.from_iterable(node_lists), devs)):
        bounds = []
        start = 0
        for lst in node_lists:
            bounds.append((start, start + len(lst)))
            start += len(lst)
        _LAST_ORDER[:] = [(devs, pos, bounds, entries)]
    else:
        _LAST_ORDER.clear()
    return entries


def _interned(entry: tuple[list[DeviceState], NodeSig]) -> tuple[list[DeviceState], NodeSig]:
    if len(_SIG_OBJECTS) > 10_000:
        _SIG_OBJECTS.clear()
    return entry[0], _SIG_OBJECTS.setdefault(entry[1], entry[1])


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
    if variant == "halve":  # the slow device keeps half its group at work: k/2 fast + k/2 with it
        return [(lo, lo + size // 2), (lo + size // 2, hi)]
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
