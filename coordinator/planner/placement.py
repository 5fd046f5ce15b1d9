"""Where the joint search's shapes land: the healthy devices per node, the TP-group pools a
shape draws from, their concrete rank groups, and the Plan a chosen shape becomes.

Nodes are walked once per distinct signature (speeds and memory of their alive devices), so
a pool of 16,384 devices costs a handful of node walks; concrete groups come out in
current-plan order, so materialising a shape keeps unaffected replicas on their ranks.
``Searcher`` (planner.search) builds on this. Pure and deterministic.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import chain

from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.plan import PipelinePlan, Plan, Schedule, even_split
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.cost import Costs, PipeSig, PlannerConfig, StageKey
from resihp.coordinator.planner.groups import _NO_POSITIONS, _RANK, Pool, ShapeResult, node_order, node_ranges
from resihp.coordinator.planner.split import profile

# (id(a node's alive-device list), tp size, variant) -> (that list, its groups as (type, ranks))
_NODE_GROUPS: dict[tuple[int, int, str], tuple[list[DeviceState], list[tuple[StageKey, tuple[int, ...]]]]] = {}


class Placement:
    """The healthy devices of one search, their pools and concrete groups, and materialisation."""

    def __init__(
        self, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, current: Plan | None, config: PlannerConfig,
        schedule: Schedule | None = None, virtual_chunks: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.spec = spec
        self.batch = batch
        self.config = config
        self.current = current
        sched = schedule or (current.schedule if current is not None else Schedule.ONE_F_ONE_B)
        v = virtual_chunks or (current.virtual_chunks if current is not None else 1)
        self.costs = Costs(cluster, spec, batch, config, sched, v if sched is Schedule.INTERLEAVED else 1)
        self.v = self.costs.v
        # healthy devices per node, sorted by speed, memory, then current position
        # rank -> (replica, stage, tp index, tp size): positions are unique, so ordering by it
        # orders by (replica, stage, tp index)
        pos: Mapping[int, tuple[int, ...]] = current.position_table() if current is not None else _NO_POSITIONS
        entries = node_order(cluster, pos)
        self.node_devs: list[list[DeviceState]] = [alive for alive, _ in entries if alive]  # read-only
        self.node_sigs: list[tuple[tuple[float, float], ...]] = [sig for alive, sig in entries if alive]
        # nodes with the same signature form groups alike: pools walk the distinct ones.
        # Signatures are interned, so they are counted by identity (hashing 2,048 of them
        # costs more); equal ones under two objects are merged, first node first
        ids = list(map(id, self.node_sigs))
        self._sig_count: dict[tuple[tuple[float, float], ...], tuple[int, int]] = {}  # sig -> (first node, count)
        first_of = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))  # id -> its first node
        for sid, n in Counter(ids).items():
            first = first_of[sid]
            sig = self.node_sigs[first]
            hit = self._sig_count.get(sig)
            self._sig_count[sig] = (first, n) if hit is None else (hit[0], hit[1] + n)
        self._concrete: dict[tuple[int, str, int, int], dict[StageKey, list[tuple[int, ...]]]] = {}
        if not self.node_devs:
            raise SpecError("planner: no healthy device left in the cluster; nothing can run")
        self._pos = pos

    # --- pools --------------------------------------------------------------------------
    def _node_tp(self, tp: int, split: int, depth: int = 1) -> list[int]:
        """TP size per node: the ``split`` weakest nodes (least total speed, later first) use
        tp >> depth."""
        sizes = [tp] * len(self.node_devs)
        if split and tp >> depth >= 1:
            weakest = sorted(range(len(self.node_devs)),
                             key=lambda i: (sum(d.speed for d in self.node_devs[i]), -i))[:split]
            for i in weakest:
                sizes[i] = tp >> depth
        return sizes

    def pool(self, tp: int, variant: str, split: int = 0, depth: int = 1) -> Pool:
        counts: dict[StageKey, int] = {}
        memo: dict[tuple[object, int], list[StageKey]] = {}

        def keys_of(devs: list[DeviceState], sig: tuple[object, ...], size: int) -> list[StageKey]:
            keys = memo.get((sig, size))
            if keys is None:
                speeds = [d.speed for d in devs]
                keys = [
                    (b - a, min(speeds[a:b]), min(float(devs[i].memory_bytes) for i in range(a, b)))
                    for a, b in node_ranges(speeds, size, variant)
                ]
                memo[(sig, size)] = keys
            return keys

        if split == 0:  # every node at tp: one walk per distinct node signature
            for sig, (first, n) in self._sig_count.items():
                for key in keys_of(self.node_devs[first], sig, tp):
                    counts[key] = counts.get(key, 0) + n
        else:
            for devs, sig, size in zip(self.node_devs, self.node_sigs, self._node_tp(tp, split, depth)):
                for key in keys_of(devs, sig, size):
                    counts[key] = counts.get(key, 0) + 1
        rate = {key: 1.0 / self.costs.per_layer_s(key[0], key[1]) for key in counts}
        types = sorted(counts.items(), key=lambda kv: (-rate[kv[0]], -kv[0][0], -kv[0][2]))
        return Pool(tp, variant, types, rate, split, depth)

    def concrete_groups(self, pool: Pool) -> dict[StageKey, list[tuple[int, ...]]]:
        """Concrete rank tuples per type, in current-plan order (so popping them in order
        rebuilds unaffected pipelines exactly)."""
        hit = self._concrete.get((pool.tp, pool.variant, pool.split, pool.depth))
        if hit is not None:
            return hit
        out: dict[StageKey, list[tuple[int, ...]]] = {}
        memo: dict[tuple[int, int], tuple[list[tuple[int, int, StageKey]], bool]] = {}
        far = (1 << 30, 0, 0)
        cache = _NODE_GROUPS
        if len(cache) > 200_000:
            cache.clear()
        variant = pool.variant
        for devs, sig, size in zip(self.node_devs, self.node_sigs, self._node_tp(pool.tp, pool.split, pool.depth)):
            # a node's alive-device list is ordered for one position table (node_order), so
            # its groups are the same for every search that gets the same list object
            node = cache.get((id(devs), size, variant))
            if node is None or node[0] is not devs:
                got = memo.get((id(sig), size))  # signatures are interned (node_order); all alive here
                if got is None:  # the cuts and types depend only on the node's speeds and memory
                    speeds = [d.speed for d in devs]
                    got = memo[(id(sig), size)] = ([
                        (a, b, (b - a, min(speeds[a:b]), min(float(d.memory_bytes) for d in devs[a:b])))
                        for a, b in node_ranges(speeds, size, variant)
                    ], sig[0] == sig[-1] and len(set(sig)) == 1)  # uniform: already in (position, rank) order
                cuts, uniform = got
                groups: list[tuple[StageKey, tuple[int, ...]]] = []
                for a, b, key in cuts:
                    members = devs[a:b]
                    if not uniform:
                        members = sorted(members, key=lambda d: (self._pos.get(d.rank, far), d.rank))
                    groups.append((key, tuple(map(_RANK, members))))
                node = cache[(id(devs), size, variant)] = (devs, groups)
            for key, ranks in node[1]:
                lst = out.get(key)
                if lst is None:
                    lst = out[key] = []
                lst.append(ranks)
        get = self._pos.get
        for key, lst in out.items():  # by (position of the first member, ranks)
            order = [(get(g[0], far), g) for g in lst]
            order.sort()
            out[key] = [g for _, g in order]
        self._concrete[(pool.tp, pool.variant, pool.split, pool.depth)] = out
        return out

    # --- materialisation ------------------------------------------------------------------
    def materialise(self, shape: ShapeResult, reason: str) -> Plan:
        replicas, spares = self._parts(shape)
        epoch = self.current.epoch + 1 if self.current is not None else 0
        return Plan(tuple(replicas), self.costs.schedule, self.v, epoch, spares, reason)

    def _parts(self, shape: ShapeResult) -> tuple[list[PipelinePlan], tuple[int, ...]]:
        """The concrete replicas and spares of a shape (a Plan is built only for the chosen one)."""
        queues = self.concrete_groups(shape.pool)
        take = {key: iter(q).__next__ for key, q in queues.items()}  # pop each type's groups in order
        replicas: list[PipelinePlan] = []
        used: dict[StageKey, int] = {}  # groups popped per type
        splits: dict[tuple[PipeSig, int], tuple[int, ...]] = {}  # identical pipelines share a split
        for (sig, count), row in zip(shape.classes, shape.shares):
            pops = [take[key] for key in sig.stages]
            for key in sig.stages:
                used[key] = used.get(key, 0) + count
            for i in range(count):
                stages = [pop() for pop in pops]
                m = row[i]
                layers = splits.get((sig, m))
                if layers is None:
                    res = profile(self.costs, sig).best(max(m, 1))
                    assert res is not None
                    layers = splits[(sig, m)] = self._virtual(res[1])
                replicas.append(PipelinePlan(tuple(stages), layers, m))
        # keep replicas in current order where possible (stable, deterministic)
        far = (1 << 30, 0, 0)
        replicas.sort(key=lambda rep: (self._pos.get(rep.stages[0][0], far), rep.stages[0]))
        # the groups partition the healthy devices: the spares are the groups left unpopped
        left = chain.from_iterable(q[used.get(key, 0):] for key, q in queues.items())
        spares = tuple(sorted(chain.from_iterable(left)))
        return replicas, spares

    def _virtual(self, per_device: Sequence[int]) -> tuple[int, ...]:
        if self.v == 1:
            return tuple(per_device)
        p = len(per_device)
        chunks = [even_split(n, self.v) for n in per_device]
        return tuple(chunks[j % p][j // p] for j in range(p * self.v))

