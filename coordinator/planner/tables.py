"""Per-cluster lookups of the planner (speed, memory, node of each rank, pipeline
signatures), built once per cluster object, and derived from the previous cluster's when
the new one differs in a few devices.

A decision meets several 16K-device clusters that differ from one another in a handful
of devices (the simulator's view, the view with the finding applied, the view without
slow links): a from-scratch build walks every device, a derivation copies the tables and
edits the changed ranks. Both give the same tables. Pure.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter, is_not

from resihp.coordinator.model.cluster import Cluster, DeviceState

# A stage as the cost model sees it: (tp size, slowest member's speed, smallest member memory)
StageKey = tuple[int, float, float]


@dataclass(frozen=True)
class PipeSig:
    """A pipeline up to renaming of devices: its stages in order. Every stage edge is priced
    at the inter-node link (pessimistic for a pipeline inside one node, and it keeps
    pipelines on interchangeable nodes identical, which the search relies on)."""

    stages: tuple[StageKey, ...]

    def __hash__(self) -> int:
        # hashed for every memo lookup of the search (pipeline times, splits): computed once
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.stages,))  # what the generated __hash__ returns
            self.__dict__["_hash"] = h
        return h


@dataclass(frozen=True)
class ClusterTables:
    """Per-rank lookups of one cluster, built once per cluster object (a decision asks for
    them many times, and at 16K devices each build walks every device). Read-only, except
    the two memo fields at the end."""

    devs: dict[int, DeviceState]
    node_of: dict[int, object]
    least_memory: int
    failed: frozenset[int]
    speed: dict[int, float]
    memory: dict[int, float]
    slow_links: dict[int, float]  # link factor != 1 only
    index: dict[int, int]  # rank -> its position in cluster.devices
    # every rank not at ``top`` (speed, memory): a TP group without any has the stage key
    # (size, *top); ``special`` adds the link-slow ranks. A derived table keeps its base's
    # ``top`` (the largest speed and memory when built), so an odd rank may be faster
    top: tuple[float, float]
    odd: frozenset[int]
    special: frozenset[int]
    sigs: dict[tuple[tuple[int, ...], ...], PipeSig] = field(default_factory=dict)  # stages -> signature
    plain_sigs: dict[tuple[int, ...], PipeSig] = field(default_factory=dict)  # TP sizes -> signature (no odd rank)
    one_node: set[tuple[int, ...]] = field(default_factory=set)  # TP groups known to sit in one node
    one_node_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # the same, by id (holding the tuple)

    def sig(self, stages: tuple[tuple[int, ...], ...]) -> PipeSig:
        """``pipe_sig(speed, memory, stages)``, memoised; groups without an odd rank take the
        top speed and memory without a look-up."""
        hit = self.sigs.get(stages)
        if hit is None:
            odd = self.odd
            if not odd or odd.isdisjoint(chain.from_iterable(stages)):
                hit = self.plain_sig(tuple(map(len, stages)))
            else:
                hit = pipe_sig(self.speed, self.memory, stages)
            self.sigs[stages] = hit
        return hit

    def plain_sig(self, sizes: tuple[int, ...]) -> PipeSig:
        """The signature of a pipeline with these TP sizes and no odd rank."""
        hit = self.plain_sigs.get(sizes)
        if hit is None:
            sp, mem = self.top
            hit = self.plain_sigs[sizes] = PipeSig(tuple([(k, sp, mem) for k in sizes]))
        return hit


def pipe_sig(speed: dict[int, float], mem: dict[int, float], stages: Sequence[Sequence[int]]) -> PipeSig:
    sp, mm = speed.__getitem__, mem.__getitem__
    return PipeSig(tuple([(len(g), min(map(sp, g)), min(map(mm, g))) for g in stages]))


_TABLES: dict[int, tuple[Cluster, ClusterTables]] = {}
_DEVICE_FIELDS = attrgetter("rank", "node", "memory_bytes")


def cluster_tables(cluster: Cluster) -> ClusterTables:
    hit = _TABLES.get(id(cluster))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    out = None
    if _TABLES:  # the last cluster seen: clusters derived from one another come in a row
        base, base_tab = next(reversed(_TABLES.values()))
        out = _derived(base, base_tab, cluster)
    if out is None:
        out = _built(cluster)
    if len(_TABLES) >= 8:
        _TABLES.clear()
    _TABLES[id(cluster)] = (cluster, out)
    return out


def _built(cluster: Cluster) -> ClusterTables:
    dl = cluster.devices
    ranks = list(map(attrgetter("rank"), dl))
    speeds = list(map(attrgetter("speed"), dl))
    mem = list(map(float, map(attrgetter("memory_bytes"), dl)))
    links = list(map(attrgetter("link_factor"), dl))
    failed = list(map(attrgetter("failed"), dl))
    top = (max(speeds), max(mem))
    odd = frozenset(r for r, s, m in zip(ranks, speeds, mem) if s != top[0] or m != top[1])
    slow = {r: f for r, f in zip(ranks, links) if f != 1.0}
    return ClusterTables(
        dict(zip(ranks, dl)), dict(zip(ranks, map(attrgetter("node"), dl))),
        min(map(attrgetter("memory_bytes"), dl)), frozenset(r for r, f in zip(ranks, failed) if f),
        dict(zip(ranks, speeds)), dict(zip(ranks, mem)), slow, dict(zip(ranks, range(len(ranks)))),
        top, odd, odd.union(slow),
    )


def _derived(base: Cluster, tab: ClusterTables, cluster: Cluster) -> ClusterTables | None:
    """``_built(cluster)`` from ``base``'s tables when the two list the same ranks on the same
    nodes with the same memory, and differ (by identity) in few devices; else None."""
    old, new = base.devices, cluster.devices
    n = len(new)
    if len(old) != n:
        return None
    changed = list(compress(range(n), map(is_not, old, new)))
    if len(changed) > max(64, n // 16):
        return None
    for i in changed:
        a, b = old[i], new[i]
        if _DEVICE_FIELDS(a) != _DEVICE_FIELDS(b) or type(a.node) is not type(b.node):
            return None
    devs = dict(tab.devs)
    speed = dict(tab.speed)
    slow = dict(tab.slow_links)
    failed = set(tab.failed)
    odd = set(tab.odd)
    top_speed, top_mem = tab.top
    for i in changed:
        d = new[i]
        r = d.rank
        devs[r] = d
        speed[r] = d.speed
        if d.link_factor != 1.0:
            slow[r] = d.link_factor
        else:
            slow.pop(r, None)
        if d.failed:
            failed.add(r)
        else:
            failed.discard(r)
        if d.speed != top_speed or tab.memory[r] != top_mem:
            odd.add(r)
        else:
            odd.discard(r)
    frozen_odd = frozenset(odd)
    # node, memory and position tables are the base's (unchanged); so is the one-node memo,
    # which depends on the nodes only
    return ClusterTables(devs, tab.node_of, tab.least_memory, frozenset(failed), speed, tab.memory, slow, tab.index,
                         tab.top, frozen_odd, frozen_odd.union(slow), one_node=tab.one_node,
                         one_node_ids=tab.one_node_ids)
