"""The planner's public face: joint TP / PP / DP re-planning around failed and slow devices.

    search_plan(cluster, model, batch, current, config) -> Plan        best layout (planner.search)
    search(cluster, model, batch, current, config) -> SearchResult     the same with its numbers
    decide(cluster, model, batch, current, finding, now, config) -> Decision   ski rental (planner.decision)
    evaluate(plan, cluster, model, batch, config) -> Evaluation        closed-form score (planner.cost)
    simulate_plan(plan, cluster, model, batch, config) -> IterationResult  schedule-simulator check

The closed form drives the search (microseconds per candidate); the chosen plan is then
replayed through the schedule simulator (coordinator/schedule/simulator.py) and that number is what
``resihp plan`` reports. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.memory import MemoryModel
from resihp.coordinator.model.plan import Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.cost import (
    Costs,
    Evaluation,
    PlannerConfig,
    device_layers,
    evaluate,
    pipe_sig,
    plan_problems,
)
from resihp.coordinator.planner.decision import Candidate, Decision, apply_finding, decide
from resihp.coordinator.planner.groups import SearchResult
from resihp.coordinator.planner.move import Move, plan_move
from resihp.coordinator.planner.search import Searcher, search_plan
from resihp.coordinator.schedule.simulator import IterationResult, ReplicaWork, simulate_iteration

__all__ = [
    "Candidate", "Cluster", "Decision", "DeviceState", "Evaluation", "GlobalBatch", "MemoryModel", "Move",
    "PlannerConfig", "SearchResult", "apply_finding", "decide", "evaluate", "plan_move", "search",
    "search_plan", "simulate_plan", "clear_memos",
]


def clear_memos() -> None:
    """Empty every memo the planner keeps between calls (shape searches, per-cluster tables,
    node orders and groups, rank-free cost tables, plan holdings), so the next call is cold:
    what a benchmark of a first decision measures, and a test that warm and cold agree."""
    from resihp.coordinator.planner import cost as planner_cost
    from resihp.coordinator.planner import groups as planner_groups
    from resihp.coordinator.planner import move as planner_move
    from resihp.coordinator.planner import placement as planner_placement
    from resihp.coordinator.planner import search as planner_search
    from resihp.coordinator.planner import tables as planner_tables

    for memo in (planner_search._SHAPES, planner_placement._NODE_GROUPS, planner_groups._NODES, planner_groups._LAYOUT,
                 planner_groups._NODE_ORDER, planner_groups._SIG_OBJECTS, planner_groups._LAST_ORDER,
                 planner_groups._UNIFORM, planner_tables._TABLES, planner_cost._MEMOS, planner_move._HOLDINGS,
                 planner_move._SAME, planner_move._GROUPS):
        memo.clear()
    planner_groups._divisors.cache_clear()


def search(
    cluster: Cluster, model: ModelSpec, batch: GlobalBatch, current: Plan | None = None,
    config: PlannerConfig | None = None,
) -> SearchResult:
    return Searcher(cluster, model, batch, current, config or PlannerConfig()).search()


def simulate_plan(
    plan: Plan, cluster: Cluster, model: ModelSpec, batch: GlobalBatch, config: PlannerConfig | None = None
) -> IterationResult:
    """Replay ``plan`` through the schedule simulator: per-stage F and B durations from the
    cost model at each stage's (slowest member's) speed, each op with its blocking inter-node send,
    the DP all-reduce and optimizer step after the slowest replica. Identical replicas are
    simulated once."""
    cfg = config or PlannerConfig()
    problems = plan_problems(plan, cluster, model, batch, cfg)
    if problems:
        raise SpecError("plan cannot run: " + "; ".join(problems))
    costs = Costs(cluster, model, batch, cfg, plan.schedule, plan.virtual_chunks)
    devs = cluster.by_rank()
    speed = {r: d.speed for r, d in devs.items()}
    mem = {r: float(d.memory_bytes) for r, d in devs.items()}
    # a communication slowdown (DeviceState.link_factor) stretches the p2p sends and the DP
    # ring, priced here at the worst link of the plan; a send is blocking, so it is part of
    # its op (as in Costs.extra_s), not a free delay between ops
    worst_link = max((devs[r].link_factor for r in plan.ranks()), default=1.0)
    hop = costs.hop_s() * worst_link
    works: list[ReplicaWork] = []
    seen: dict[tuple[object, ...], int] = {}
    shards: list[tuple[int, int, bool, bool, float]] = []
    order: list[int] = []
    for rep in plan.replicas:
        sig = pipe_sig(speed, mem, rep.stages)
        per_dev = device_layers(rep.layers, rep.pp)
        for s, (k, sp, _) in enumerate(sig.stages):
            shards.append((k, per_dev[s], s == 0, s == rep.pp - 1, sp))
        key = (sig.stages, rep.layers, rep.microbatches)
        if key in seen:
            order.append(seen[key])
            continue
        f_rows: list[list[float]] = []
        b_rows: list[list[float]] = []
        w_rows: list[list[float]] = []
        split_w = plan.schedule is Schedule.ZB_H1
        n_virtual = len(rep.layers)
        for j, layers in enumerate(rep.layers):
            s = j % rep.pp
            k, sp, _ = sig.stages[s]
            first, last = j == 0, j == n_virtual - 1
            compute = (layers * costs.layer_flops + (costs.first_flops if first else 0.0)
                       + (costs.last_flops if last else 0.0)) / (k * sp * costs.flops)
            comm = layers * costs.tp_comm_s(k)
            fwd = compute * costs.fwd_fraction + comm / 2.0
            send_f, send_b = (0.0 if last else hop), (0.0 if first else hop)
            f_rows.append([fwd + send_f] * rep.microbatches)
            if split_w:
                bwd = compute * costs.bwd_input_fraction + comm / 2.0
                b_rows.append([bwd + send_b] * rep.microbatches)
                w_rows.append([compute + comm - fwd - bwd] * rep.microbatches)
            else:
                b_rows.append([compute + comm - fwd + send_b] * rep.microbatches)
        seen[key] = len(works)
        order.append(len(works))
        works.append(ReplicaWork(f=f_rows, b=b_rows, w=w_rows if split_w else None, pp=rep.pp))
    sync = costs.sync_s(plan.dp, shards, worst_link)
    active = [w for w in works if len(w.f[0]) > 0] or works[:1]
    return simulate_iteration(plan.schedule, active, dp_sync_s=sync, p2p_s=0.0, virtual_chunks=plan.virtual_chunks)
