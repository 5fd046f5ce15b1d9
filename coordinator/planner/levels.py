"""Local repairs of the current plan, cheapest first (the escalation ladder).

- ``reshare``: same groups, same layer splits; only the micro-batch shares change
  (DP migration, no state moves).
- ``resplit``: same groups; every pipeline gets its own min-max layer split, then shares
  (PP repartition; moves the layers that change stage).
- ``regroup``: every TP group holding a failed or slow device is cut to the power-of-two
  subset of its members maximising ``k · min pᵢ`` (ResiHP's TP exclusion); replicas that
  lose every member of a stage are dropped; then resplit.
The full re-plan lives in planner.search. Each function returns a Plan or None when the
repair cannot run (a failed rank stays in it, or memory does not fit). Pure.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import chain

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.planner.cost import Costs, PipeSig, cluster_tables, device_layers
from resihp.coordinator.planner.search import Searcher
from resihp.coordinator.planner.shares import Monotone, TimeModel, allocate_shares
from resihp.coordinator.planner.split import profile


def _tables(costs: Costs) -> tuple[dict[int, float], dict[int, float], set[int]]:
    speed, mem, _ = costs.tables()
    return speed, mem, set(cluster_tables(costs.cluster).failed)


def _fixed_model(costs: Costs, sig: PipeSig, layers: tuple[int, ...]) -> TimeModel:
    return Monotone(lambda m: costs.pipeline_time(sig, layers, m))


def _with_shares(plan: Plan, replicas: list[PipelinePlan], shares: list[int], reason: str,
                 spares: tuple[int, ...] | None = None) -> Plan:
    reps = tuple(PipelinePlan(rep.stages, rep.layers, m) for rep, m in zip(replicas, shares))
    return Plan(reps, plan.schedule, plan.virtual_chunks, plan.epoch + 1,
                plan.spares if spares is None else spares, reason)


def _share(costs: Costs, models: list[TimeModel], plan: Plan | list[PipelinePlan]) -> list[int] | None:
    reps = plan.replicas if isinstance(plan, Plan) else plan
    unit = max(rep.pp for rep in reps) if costs.v > 1 else 1
    if costs.v > 1 and any(rep.pp != unit for rep in reps):
        return None
    if unit == 1:
        return one_each_shares(models, costs.batch.microbatches)
    got = allocate_shares(models, [1] * len(models), costs.batch.microbatches, unit)
    if got is None or got[0] == float("inf"):
        return None
    return [row[0] for row in got[1]]


def one_each_shares(models: list[TimeModel], total: int) -> list[int] | None:
    """``allocate_shares(models, [1] * n, total)``'s shares, with replicas that share a model
    object moved together: the greedy gives the next micro-batch to the replica finishing it
    earliest, ties to the lower index; with strictly increasing times every replica tied at
    a time t is served before any at a later time, so a level is handed out to all tied
    replicas at once and only the last, partial level goes by index. 512 replicas of a few
    shapes cost a few heap operations per level instead of one per micro-batch."""
    members: dict[int, list[int]] = {}
    for i, mod in enumerate(models):
        members.setdefault(id(mod), []).append(i)
    level = {cid: 0 for cid in members}
    model_of = {cid: models[idx[0]] for cid, idx in members.items()}
    heap = [(model_of[cid].time(1), idx[0], cid) for cid, idx in members.items()]
    heapq.heapify(heap)
    shares = [0] * len(models)
    left = total
    while left > 0:
        if not heap or heap[0][0] == float("inf"):
            return None
        t = heap[0][0]
        tied = []
        while heap and heap[0][0] == t:
            tied.append(heapq.heappop(heap)[2])
        n = sum(len(members[cid]) for cid in tied)
        if n > left:  # the last level: the lowest replica indices among the tied ones
            for i in sorted(i for cid in tied for i in members[cid])[:left]:
                shares[i] = 1
            for cid in tied:
                heapq.heappush(heap, (t, members[cid][0], cid))  # unchanged level, for the bookkeeping below
            left = 0
            break
        left -= n
        for cid in tied:
            level[cid] += 1
            nxt = model_of[cid].time(level[cid] + 1)
            if not nxt > t:  # not strictly increasing: the argument above fails, ask the general rule
                got = allocate_shares(models, [1] * len(models), total)
                return None if got is None or got[0] == float("inf") else [row[0] for row in got[1]]
            heapq.heappush(heap, (nxt, members[cid][0], cid))
    for cid, idx in members.items():
        for i in idx:
            shares[i] += level[cid]
    return shares


def reshare(costs: Costs, plan: Plan) -> Plan | None:
    speed, mem, dead = _tables(costs)
    if dead & set(plan.ranks()):
        return None
    models: list[TimeModel] = []
    cache: dict[tuple[object, ...], TimeModel] = {}
    for rep in plan.replicas:
        sig = costs.sig(rep.stages)
        layers = tuple(device_layers(rep.layers, rep.pp))
        key = (sig.stages, layers)
        if key not in cache:
            cache[key] = _fixed_model(costs, sig, layers)
        models.append(cache[key])
    shares = _share(costs, models, plan)
    if shares is None:
        return None
    return _with_shares(plan, list(plan.replicas), shares, "dp-shares")


def resplit(costs: Costs, plan: Plan, searcher: Searcher, spares: tuple[int, ...] | None = None) -> Plan | None:
    speed, mem, dead = _tables(costs)
    if dead & set(plan.ranks()):
        return None
    got = _resplit(costs, list(plan.replicas), searcher)
    if got is None:
        return None
    return _with_shares(plan, got[0], got[1], "layer-split", spares)


def _resplit(costs: Costs, reps: list[PipelinePlan], searcher: Searcher) -> tuple[list[PipelinePlan], list[int]] | None:
    speed, mem, _ = _tables(costs)
    sigs = [costs.sig(rep.stages) for rep in reps]
    models: list[TimeModel] = [profile(costs, sig) for sig in sigs]
    shares = _share(costs, models, reps)
    if shares is None:
        return None
    replicas = []
    for rep, sig, m in zip(reps, sigs, shares):
        res = profile(costs, sig).best(max(m, 1))
        if res is None:
            return None
        replicas.append(PipelinePlan(rep.stages, searcher._virtual(res[1]), m))
    return replicas, shares


def _best_subgroup(group: tuple[int, ...], speed: dict[int, float], dead: set[int]) -> tuple[int, ...]:
    alive = sorted((r for r in group if r not in dead), key=lambda r: (-speed[r], group.index(r)))
    best: tuple[int, ...] = ()
    best_v = 0.0
    k = 1
    while k <= len(alive):
        value = k * speed[alive[k - 1]]
        if value > best_v + 1e-12:  # ties keep the smaller group: exclude the sick device
            best, best_v = tuple(sorted(alive[:k], key=group.index)), value
        k *= 2
    return best


def _replicas_of(plan: Plan, ranks: Iterable[int]) -> set[int]:
    """Indices of the replicas holding any of ``ranks``."""
    pos = plan.position_table()
    return {p[0] for p in map(pos.get, ranks) if p is not None}


def regroup(costs: Costs, plan: Plan, searcher: Searcher) -> Plan | None:
    speed, _, dead = _tables(costs)
    tab = cluster_tables(costs.cluster)
    # a group can change only if it holds a failed rank or one off the top speed (odd):
    # every other group has all its members alive at one speed
    touched = _replicas_of(plan, chain(tab.odd, tab.failed))
    replicas: list[PipelinePlan] = []
    removed: list[int] = []  # ranks of the plan that the new groups leave out
    for i, rep in enumerate(plan.replicas):
        if i not in touched:
            replicas.append(rep)
            continue
        stages = []
        for group in rep.stages:
            fastest = max(speed[r] for r in group)
            if any(r in dead or speed[r] < fastest for r in group):
                sub = _best_subgroup(group, speed, dead)
                removed.extend(r for r in group if r not in sub)
                group = sub
            stages.append(group)
        if any(not g for g in stages):
            removed.extend(r for g in stages for r in g)
            continue
        replicas.append(PipelinePlan(tuple(stages), rep.layers, rep.microbatches))
    if not replicas:
        return None
    # (spares | plan ranks) - kept - dead, kept being the plan's ranks less the removed ones
    # (spares are never members)
    spares = tuple(sorted((set(plan.spares) | set(removed)) - dead))
    got = _resplit(costs, replicas, searcher)
    if got is None:
        return None
    return _with_shares(plan, got[0], got[1], "tp-regroup", spares)


def rebuild(costs: Costs, plan: Plan, searcher: Searcher) -> Plan | None:
    """Keep every healthy replica exactly as it is; rebuild each damaged one (a failed or
    slow member) from its own surviving full-speed devices — whole TP groups of the
    replica's TP size per node, in their old stage order, so the pipeline gets fewer stages
    — with its own min-max layer split. A rebuilt pipeline that cannot hold the model is
    dissolved (its devices become spares). Shares are then rebalanced over all pipelines
    (Oobleck's template re-instantiation, generalised to heterogeneous splits)."""
    speed, mem, dead = _tables(costs)
    tab = cluster_tables(costs.cluster)
    pos = plan.position_table()
    odd = {r for r in chain(tab.odd, tab.failed) if r in pos}  # members off the top speed, or failed
    top_speed = tab.top[0]
    alive = [speed[r] for r in odd if r not in dead]
    if len(pos) > len(odd):  # and the others, alive at the top speed
        alive.append(top_speed)
    if not alive:
        return None
    top = max(alive)
    # a replica is kept unless a member failed or is slower than ``top``; when ``top`` is
    # the top speed, only the odd members can be
    damaged = _replicas_of(plan, [r for r in odd if r in dead or speed[r] < top]) if top == top_speed else None
    kept: list[PipelinePlan] = []
    rebuilt: list[PipelinePlan] = []
    freed: set[int] = set()
    devs = tab.devs
    for i, rep in enumerate(plan.replicas):
        if damaged is not None and i not in damaged:
            kept.append(rep)
            continue
        ranks = rep.ranks()
        if not any(r in dead or speed[r] < top for r in ranks):
            kept.append(rep)
            continue
        tp = max(len(g) for g in rep.stages)
        by_node: dict[str, list[int]] = {}
        for g in rep.stages:
            for r in g:
                if r not in dead and speed[r] >= top:
                    by_node.setdefault(str(devs[r].node), []).append(r)
        groups: list[tuple[int, ...]] = []
        for members in by_node.values():
            for i in range(0, len(members) - tp + 1, tp):
                groups.append(tuple(members[i:i + tp]))
        freed.update(r for r in ranks if r not in dead)
        if groups and len(groups) <= costs.spec.num_layers // costs.v:
            rebuilt.append(PipelinePlan(tuple(groups), (), 0))
    if not kept and not rebuilt:
        return None
    reps = kept + rebuilt
    models: list[TimeModel] = []
    cache: dict[tuple[object, ...], TimeModel] = {}
    for rep in kept:
        sig = costs.sig(rep.stages)
        layers = tuple(device_layers(rep.layers, rep.pp))
        key = (sig.stages, layers)
        if key not in cache:
            cache[key] = _fixed_model(costs, sig, layers)
        models.append(cache[key])
    sigs = [costs.sig(rep.stages) for rep in rebuilt]
    models.extend(profile(costs, sig) for sig in sigs)
    shares = _share(costs, models, reps)
    if shares is None:
        return None
    out: list[PipelinePlan] = list(kept)
    for rep, sig, m in zip(rebuilt, sigs, shares[len(kept):]):
        if m == 0:
            continue  # the rebuilt pipeline is too slow to be worth a micro-batch
        res = profile(costs, sig).best(m)
        if res is None:
            return None
        out.append(PipelinePlan(rep.stages, searcher._virtual(res[1]), m))
    final = [m for m in shares[:len(kept)]] + [rep.microbatches for rep in out[len(kept):]]
    used = {r for rep in out for r in rep.ranks()}
    spares = tuple(sorted((set(plan.spares) | freed) - used - dead))
    reps_out = [PipelinePlan(rep.stages, rep.layers, m) for rep, m in zip(out, final)]
    return Plan(tuple(reps_out), plan.schedule, plan.virtual_chunks, plan.epoch + 1, spares, "replica-rebuild")
