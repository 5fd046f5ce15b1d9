"""The planner's speed paths give the answers of the plain computations they replace:
Plan validation (same errors, first problem named), rank lookups, the memoised node
grouping, the state-move pricing, the search with its per-node memo, cluster tables and
node orders derived from the previous cluster, the search's spares, and the repairs that
walk only the damaged replicas."""
from __future__ import annotations

import random

import pytest

from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.memory import MemoryModel
from resihp.coordinator.model.plan import PipelinePlan, Plan, RankPosition, Schedule
from resihp.coordinator.model.spec import SpecError, preset
from resihp.coordinator.planner import groups as planner_groups
from resihp.coordinator.planner import levels as planner_levels
from resihp.coordinator.planner import move as planner_move
from resihp.coordinator.planner import search as planner_search
from resihp.coordinator.planner import tables as planner_tables
from resihp.coordinator.planner.groups import cluster_nodes
from resihp.coordinator.planner.planner import PlannerConfig, clear_memos, decide, plan_move, search

SPEC = preset("llama2-7b")
BATCH = GlobalBatch(32, 4096)


def rep(stages: list[list[int]], layers: list[int], mb: int = 1) -> PipelinePlan:
    return PipelinePlan(tuple(tuple(g) for g in stages), tuple(layers), mb)


@pytest.mark.parametrize("replicas,kwargs,message", [
    ([rep([[0, 1], [2, 3]], [16, 16]), rep([[4, 1], [5, 6]], [16, 16])], {},
     "plan: rank 1 appears twice (replica 1 stage 0)"),
    ([rep([[0, 0]], [32])], {}, "plan: rank 0 appears twice (replica 0 stage 0)"),
    # the first problem in plan order wins: replica 0's duplicate before replica 1's layers
    ([rep([[0], [0]], [16, 16]), rep([[1]], [0])], {}, "plan: rank 0 appears twice (replica 0 stage 1)"),
    ([rep([[0]], [32]), rep([[1], [1]], [0, 32])], {}, "plan: replica 1 has a stage with no layers: [0, 32]"),
    ([rep([[0], []], [16, 16])], {}, "plan: replica 0 stage 1 has an empty TP group"),
    ([rep([[0], [1]], [32])], {}, "plan: replica 0 lists 1 layer counts; expected pp × virtual_chunks = 2 × 1"),
    ([rep([[0]], [32], -1)], {}, "plan: replica 0 has a negative micro-batch share (-1)"),
    ([rep([], [])], {}, "plan: replica 0 has no stages"),
    ([rep([[0], [1]], [16, 16])], {"spares": (1, 7)}, "plan: ranks [1] are both spares and members of a stage"),
    ([rep([[0], [1]], [16, 16])], {"virtual_chunks": 2}, "plan: virtual_chunks > 1 needs the interleaved-1f1b"),
])
def test_plan_rejects_what_it_always_rejected(replicas: list[PipelinePlan], kwargs: dict[str, object],
                                              message: str) -> None:
    with pytest.raises(SpecError) as err:
        Plan(tuple(replicas), **kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


def test_plan_lookups_agree_with_the_layout() -> None:
    plan = Plan((rep([[3, 2], [0]], [20, 12], 5), rep([[7], [6, 5]], [16, 16], 3)), spares=(9,))
    assert plan.ranks() == (0, 2, 3, 5, 6, 7)
    assert plan.position(2) == RankPosition(0, 0, 1, 2)
    assert plan.position(5) == RankPosition(1, 1, 1, 2)
    assert dict(plan.position_table()) == {3: (0, 0, 0, 2), 2: (0, 0, 1, 2), 0: (0, 1, 0, 1),
                                           7: (1, 0, 0, 1), 6: (1, 1, 0, 2), 5: (1, 1, 1, 2)}
    assert plan.has_rank(6) and not plan.has_rank(9) and not plan.has_rank(4)
    with pytest.raises(SpecError, match="rank 9 is not part of this plan"):
        plan.position(9)
    # equality and hashing ignore the caches
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and hash(again) == hash(plan)


def test_validate_for_names_the_first_problem() -> None:
    good = Plan((rep([[0, 1], [2, 3]], [16, 16]),))
    good.validate_for(32, 32)
    with pytest.raises(SpecError, match="replica 0 runs 31 layers, the model has 32"):
        Plan((rep([[0, 1, 2]], [31]),)).validate_for(32, 32)
    with pytest.raises(SpecError, match="replica 1 stage 0 has TP size 3"):
        Plan((rep([[0, 1]], [32]), rep([[2, 3, 4]], [32]))).validate_for(32, 32)


def cluster_of(devs: list[DeviceState]) -> Cluster:
    return Cluster(tuple(devs))


def test_cluster_nodes_matches_the_cluster_in_every_layout() -> None:
    rng = random.Random(3)
    base = [DeviceState(r, r // 4) for r in range(16)]
    shuffled = list(base)
    rng.shuffle(shuffled)
    interleaved = [DeviceState(r, r % 3) for r in range(12)]  # node runs are not contiguous
    named = [DeviceState(r, f"n{r // 2}") for r in range(6)]
    for devs in (base, shuffled, interleaved, named, base):  # base twice: the layout cache hits
        c = cluster_of(devs)
        assert cluster_nodes(c) == c.nodes()
        derived = c.with_failed([devs[0].rank]).with_speeds({devs[-1].rank: 0.5})
        assert cluster_nodes(derived) == derived.nodes()


def reference_move(old: Plan, new: Plan, num_layers: int, mem: MemoryModel) -> float:
    """Per rank, without any memo: what the new plan's ranks must receive."""
    before = planner_move._holdings_of(old.replicas, num_layers)
    after = planner_move._holdings_of(new.replicas, num_layers)
    per_layer = SPEC.params_per_layer() * mem.moved_bytes_per_param
    per_emb = SPEC.embedding_params() * mem.moved_bytes_per_param
    total = 0.0
    for rank, (ranges, t, k) in after.items():
        total += planner_move._inflow(ranges, t, k, before.get(rank), num_layers, per_layer, per_emb, {})
    return total


def test_move_pricing_matches_the_per_rank_reference() -> None:
    old = Plan.uniform(2, 2, 4, 32, 32)
    same_groups_new_split = Plan(tuple(PipelinePlan(r.stages, (20, 12), r.microbatches) for r in old.replicas))
    regrouped = Plan.uniform(4, 2, 2, 32, 32)
    partly_kept = Plan(old.replicas[:2] + tuple(PipelinePlan(r.stages, (12, 20), r.microbatches)
                                                for r in old.replicas[2:]))
    mem = MemoryModel()
    for new in (old, same_groups_new_split, regrouped, partly_kept):
        move = plan_move(old, new, SPEC, mem, 25e9)
        assert move.bytes_total == int(reference_move(old, new, 32, mem))
    assert plan_move(old, old, SPEC, mem, 25e9).bytes_total == 0


def test_search_and_decide_are_unchanged_by_warm_memos() -> None:
    cluster = Cluster.uniform(8, 8)
    current = search(cluster, SPEC, BATCH).plan
    slow = cluster.with_speeds({5: 0.5, 21: 0.25})
    finding = type("F", (), {"kind": "fail-slow", "ranks": (21,), "factor": 4.0, "cause": "compute",
                             "time_s": 0.0})()
    first = decide(slow, SPEC, BATCH, current, finding, 0.0, PlannerConfig())
    again = decide(slow, SPEC, BATCH, current, finding, 0.0, PlannerConfig())  # per-node and per-cluster memos warm
    clear_memos()
    cold = decide(slow, SPEC, BATCH, current, finding, 0.0, PlannerConfig())
    for d in (again, cold):
        assert (d.act, d.level, d.plan, d.move_bytes) == (first.act, first.level, first.plan, first.move_bytes)
        assert d.predicted_iteration_s_after == first.predicted_iteration_s_after
    # a different current plan (a new position table) must not reuse the old node order
    other = Plan.uniform(8, 1, 8, SPEC.num_layers, BATCH.microbatches, Schedule.ONE_F_ONE_B)
    fresh = search(slow, SPEC, BATCH, other).plan
    clear_memos()
    assert search(slow, SPEC, BATCH, other).plan == fresh


class _Line:
    """time(m) = a·m + b for m >= 1 (0 at m = 0); ``inf_from``: infeasible from there on."""

    def __init__(self, a: float, b: float, inf_from: int = 1 << 30) -> None:
        self.a, self.b, self.inf_from = a, b, inf_from

    def time(self, m: int) -> float:
        if m == 0:
            return 0.0
        return float("inf") if m >= self.inf_from else self.a * m + self.b

    def max_m(self, tau: float, limit: int) -> int:
        return max([m for m in range(limit + 1) if self.time(m) <= tau], default=0)


def test_one_each_shares_equal_the_general_greedy() -> None:
    from resihp.coordinator.planner.levels import one_each_shares
    from resihp.coordinator.planner.shares import allocate_shares

    rng = random.Random(7)
    for trial in range(300):
        kinds = [_Line(rng.choice([1.0, 2.0, 0.5, 1.5]), rng.choice([0.0, 1.0, 0.5]),
                       rng.choice([1 << 30, 1 << 30, 3, 6])) for _ in range(rng.randint(1, 4))]
        if trial % 3 == 0:  # distinct objects with equal times: ties across shapes go by index
            kinds.append(_Line(kinds[0].a, kinds[0].b, kinds[0].inf_from))
        models = [rng.choice(kinds) for _ in range(rng.randint(1, 24))]
        total = rng.randint(0, 80)
        got = allocate_shares(models, [1] * len(models), total)
        want = None if got is None or got[0] == float("inf") else [row[0] for row in got[1]]
        assert one_each_shares(models, total) == want, (trial, total)  # type: ignore[arg-type]
    flat = _Line(0.0, 1.0)  # not strictly increasing: falls back to the general rule
    assert one_each_shares([flat, flat, _Line(1.0, 0.0)], 5) == [  # type: ignore[list-item]
        row[0] for row in allocate_shares([flat, flat, _Line(1.0, 0.0)], [1, 1, 1], 5)[1]]  # type: ignore[index]


# --- per-cluster tables and node orders derived from the previous cluster -------------------

def _edit(cluster: Cluster, rng: random.Random, n: int) -> Cluster:
    """A few devices failed, slowed, link-slowed or restored (new device objects)."""
    devs = list(cluster.devices)
    for i in rng.sample(range(len(devs)), n):
        d = devs[i]
        devs[i] = DeviceState(d.rank, d.node, rng.choice([1.0, 1.0, 0.5, 0.25, 2.0]), rng.random() < 0.3,
                              d.memory_bytes, rng.choice([1.0, 1.0, 3.0]))
    return Cluster(tuple(devs))


def _fields(tab: planner_tables.ClusterTables) -> tuple[object, ...]:
    return (tab.devs, tab.node_of, tab.least_memory, tab.failed, tab.speed, tab.memory, tab.slow_links, tab.index)


def test_derived_cluster_tables_equal_a_fresh_build() -> None:
    rng = random.Random(11)
    cluster = Cluster.uniform(16, 8)
    previous = planner_tables.cluster_tables(cluster)
    for _ in range(30):
        derived = _edit(cluster, rng, rng.randint(0, 6))
        got = planner_tables.cluster_tables(derived)  # derived from the previous cluster's tables
        assert got.node_of is previous.node_of  # (shared: it was derived, not built)
        fresh = planner_tables._built(derived)
        assert _fields(got) == _fields(fresh)
        assert all(got.devs[r].speed == got.top[0] and got.memory[r] == got.top[1]
                   for r in got.devs if r not in got.odd)
        assert got.special == got.odd | got.slow_links.keys()
        for _ in range(5):
            stages = tuple(tuple(rng.sample(range(128), rng.choice([1, 2, 4]))) for _ in range(rng.randint(1, 4)))
            assert got.sig(stages) == planner_tables.pipe_sig(fresh.speed, fresh.memory, stages)
        cluster, previous = derived, got


def test_node_order_of_a_derived_cluster_equals_the_per_node_order() -> None:
    rng = random.Random(5)
    cluster = Cluster.uniform(8, 8)
    plan = Plan.uniform(4, 2, 8, SPEC.num_layers, BATCH.microbatches)
    flipped = Plan(tuple(PipelinePlan(tuple(g[::-1] for g in r.stages), r.layers, r.microbatches)
                         for r in plan.replicas))  # the same groups, members in the other order
    tables = [plan.position_table(), flipped.position_table(), {}]
    for i in range(30):
        cluster = _edit(cluster, rng, rng.randint(0, 4))
        pos = tables[i // 3 % 3]  # a few clusters under one plan, then another plan's order
        got = planner_groups.node_order(cluster, pos)
        want = [planner_groups._order_node(list(devs), pos) for devs in cluster.nodes().values()]
        assert [(list(a), s) for a, s in got] == [(list(a), s) for a, s in want]


def test_search_spares_are_the_healthy_devices_left_over() -> None:
    cluster = Cluster.uniform(8, 8).with_failed([3, 17]).with_speeds({9: 0.5, 40: 0.3})
    for current in (None, Plan.uniform(8, 2, 4, SPEC.num_layers, BATCH.microbatches)):
        plan = search(cluster, SPEC, BATCH, current).plan
        alive = {d.rank for d in cluster.devices if not d.failed}
        assert set(plan.spares) == alive - set(plan.ranks()) and list(plan.spares) == sorted(plan.spares)


def _reference_regroup_spares(plan: Plan, cluster: Cluster
                              ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], ...]]]:
    """tp-regroup's groups and spares, walking every group (what the fast path skips)."""
    speed = {d.rank: d.speed for d in cluster.devices}
    dead = {d.rank for d in cluster.devices if d.failed}
    kept: list[tuple[tuple[int, ...], ...]] = []
    for r in plan.replicas:
        stages = []
        for g in r.stages:
            if any(x in dead or speed[x] < max(speed[y] for y in g) for x in g):
                g = planner_levels._best_subgroup(g, speed, dead)
            stages.append(g)
        if all(stages):
            kept.append(tuple(stages))
    members = {x for st in kept for g in st for x in g}
    return tuple(sorted((set(plan.spares) | set(plan.ranks())) - members - dead)), kept


def test_regroup_and_rebuild_touch_only_damaged_replicas_as_the_full_walk_does() -> None:
    from resihp.coordinator.planner.cost import Costs

    rng = random.Random(2)
    base = Cluster.uniform(8, 8)
    current = search(base, SPEC, BATCH).plan
    cfg = PlannerConfig()
    for _ in range(12):
        cluster = _edit(base, rng, rng.randint(1, 5))
        costs = Costs(cluster, SPEC, BATCH, cfg, current.schedule, current.virtual_chunks)
        searcher = planner_search.Searcher(cluster, SPEC, BATCH, current, cfg)
        got = planner_levels.regroup(costs, current, searcher)
        spares, kept = _reference_regroup_spares(current, cluster)
        if got is not None:
            assert got.spares == spares and [r.stages for r in got.replicas] == kept
        rebuilt = planner_levels.rebuild(costs, current, searcher)
        if rebuilt is not None:  # kept first, as they were: no member failed or slower than the fastest
            dead = {d.rank for d in cluster.devices if d.failed}
            speed = {d.rank: d.speed for d in cluster.devices}
            top = max(speed[x] for x in current.ranks() if x not in dead)
            kept_reps = [r for r in current.replicas if all(x not in dead and speed[x] >= top for x in r.ranks())]
            assert [r.stages for r in rebuilt.replicas[:len(kept_reps)]] == [r.stages for r in kept_reps]
            assert all(r.stages not in {k.stages for k in kept_reps} for r in rebuilt.replicas[len(kept_reps):])
