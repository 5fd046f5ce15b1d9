"""Document-granular DP shares: the plan field, the cost model's unequal micro-batches, the
planner's share split (same count or fewer micro-batches, within the activation budget) and
the simulator's pricing of them."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import SpecError, preset
from resihp.coordinator.planner.cost import (
    Costs,
    PlannerConfig,
    device_layers,
    evaluate,
    plan_problems,
    share_fractions,
)
from resihp.coordinator.planner.decision import decide
from resihp.coordinator.planner.docshares import document_shares
from resihp.coordinator.planner.levels import reshare
from resihp.coordinator.planner.search import Searcher
from resihp.coordinator.protocol.codec import plan_from_json, plan_to_json
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.world import World

SPEC = preset("llama2-13b")
PACKED = GlobalBatch(128, 4096, (1024,) * 4)  # four 1K documents per 4K micro-batch
CURRENT = Plan.uniform(4, 8, 8, 40, 128)
SLOW = Cluster.uniform(32, 8).with_speeds({37: 1 / 1.5})


def test_plan_token_share_round_trips_and_old_plans_read_unchanged() -> None:
    rep = CURRENT.replicas[0]
    shared = replace(CURRENT, replicas=(replace(rep, tokens=60000),) + CURRENT.replicas[1:])
    data = shared.to_dict()
    assert data["replicas"][0]["tokens"] == 60000
    assert "tokens" not in data["replicas"][1]  # whole micro-batches write what older readers know
    assert Plan.from_dict(data) == shared
    assert plan_from_json(plan_to_json(shared)) == shared
    assert Plan.from_dict(CURRENT.to_dict()).replicas[0].tokens == 0
    assert shared.global_tokens(4096) == 60000 + 7 * 16 * 4096
    assert "mb 16:60000t,16" in shared.describe()
    with pytest.raises(SpecError, match="needs at least one micro-batch"):
        Plan((PipelinePlan(((0,),), (40,), 0, tokens=5),))


def test_stage_time_scales_compute_and_bytes_not_latency() -> None:
    costs = Costs(SLOW, SPEC, PACKED, PlannerConfig())
    whole = costs.extra_s(4, 1.0, False, False) + 5 * costs.per_layer_s(4, 1.0)
    assert costs.stage_s(4, 1.0, 5, False, False, 1.0) == pytest.approx(whole, rel=1e-12)
    half = costs.stage_s(4, 1.0, 5, False, False, 0.5)
    assert whole / 2 < half < whole  # latencies stay whole
    sig = costs.sig(CURRENT.replicas[0].stages)
    layers = tuple(device_layers(CURRENT.replicas[0].layers, 8))
    assert costs.pipeline_time(sig, layers, 16, 0.5) < costs.pipeline_time(sig, layers, 16)


def test_shares_follow_speed_to_within_a_document() -> None:
    cfg = PlannerConfig(document_shares=True)
    costs = Costs(SLOW, SPEC, PACKED, cfg)
    got = document_shares(costs, CURRENT)
    assert got is not None and got == document_shares(costs, CURRENT)  # deterministic
    assert not plan_problems(got, SLOW, SPEC, PACKED, cfg)
    assert got.global_tokens(4096) == 128 * 4096  # the global batch is unchanged
    slow = CURRENT.position(37).replica
    shares = [rep.share_tokens(4096) for rep in got.replicas]
    assert shares[slow] < min(s for i, s in enumerate(shares) if i != slow)
    whole = reshare(costs, CURRENT)
    assert whole is not None
    t_doc = evaluate(got, SLOW, SPEC, PACKED, cfg).iteration_s
    t_whole = evaluate(whole, SLOW, SPEC, PACKED, cfg).iteration_s
    assert t_doc < t_whole * 0.99
    # within one document of the makespan: moving one more document to any replica can only
    # make that replica the slowest
    times = evaluate(got, SLOW, SPEC, PACKED, cfg).replica_s
    assert max(times) - min(times) < max(times) * 0.05
    # one document per micro-batch: nothing finer to cut
    assert document_shares(Costs(SLOW, SPEC, GlobalBatch(128, 4096), cfg), CURRENT) is None


def test_each_replica_takes_the_cheaper_packing() -> None:
    cfg = PlannerConfig(document_shares=True)
    cluster = Cluster.uniform(32, 8).with_speeds({r: 0.5 for r in range(32)})  # replica 0 at half speed
    costs = Costs(cluster, SPEC, PACKED, cfg)
    got = document_shares(costs, CURRENT)
    assert got is not None
    rep = got.replicas[0]
    docs = rep.tokens * 4 // 4096
    sig = costs.sig(rep.stages)
    layers = tuple(device_layers(rep.layers, rep.pp))

    def price(m: int) -> float:
        return costs.pipeline_time(sig, layers, m, docs / (4 * m), math.ceil(docs / m) / 4)

    same, fewer = 16, math.ceil(docs / 4)
    assert fewer < same
    assert rep.microbatches in (same, fewer)
    assert price(rep.microbatches) == min(price(same), price(fewer))


def test_largest_microbatch_respects_the_activation_budget() -> None:
    cap = 3072  # three of the four documents
    cfg = PlannerConfig(document_shares=True, max_microbatch_tokens=cap)
    got = document_shares(Costs(SLOW, SPEC, PACKED, cfg), CURRENT)
    assert got is not None
    for rep in got.replicas:
        assert share_fractions(rep, PACKED)[1] * 4096 <= cap
    # memory: a device too small for a larger micro-batch than the batch's never gets one,
    # even when the cap allows it
    roomy = PlannerConfig(document_shares=True, max_microbatch_tokens=4 * 4096)
    tight = Cluster.uniform(32, 8, memory_bytes=int(26 * 2**30)).with_speeds({37: 1 / 1.5})
    assert not plan_problems(CURRENT, tight, SPEC, PACKED, roomy)
    bigger = document_shares(Costs(tight, SPEC, PACKED, roomy), CURRENT)
    assert bigger is None or not plan_problems(bigger, tight, SPEC, PACKED, roomy)


def test_decide_uses_document_shares_only_when_configured() -> None:
    on = decide(SLOW, SPEC, PACKED, CURRENT, None, 0.0, PlannerConfig(document_shares=True))
    off = decide(SLOW, SPEC, PACKED, CURRENT, None, 0.0, PlannerConfig(document_shares=False))
    assert on.plan is not None and on.plan.document_shares
    assert off.plan is None or not off.plan.document_shares
    assert evaluate(on.plan, SLOW, SPEC, PACKED, PlannerConfig()).tokens_per_s > max(
        (evaluate(c.plan, SLOW, SPEC, PACKED, PlannerConfig()).tokens_per_s for c in off.candidates), default=0.0)


def test_simulator_prices_token_shares() -> None:
    job = JobSpec(SPEC, 4, 8, 2, 16, tokens_per_microbatch=4096, seqlens=(1024,) * 4)
    perf = PerfModel(job)
    world = World(job.world_size, job.gpus_per_node)
    plan = job.initial_plan()
    explicit = replace(plan, replicas=tuple(replace(r, tokens=r.microbatches * 4096) for r in plan.replicas))
    assert perf.iteration_s(explicit, world) == pytest.approx(perf.iteration_s(plan, world), rel=1e-12)
    a, b = plan.replicas
    lighter = replace(plan, replicas=(replace(a, tokens=6 * 4096), replace(b, tokens=10 * 4096)))
    assert perf.replica_s(lighter, 0, world) < perf.replica_s(plan, 0, world)
    assert perf.tokens_per_s(lighter, world) * perf.iteration_s(lighter, world) == pytest.approx(16 * 4096)
    assert json.loads(json.dumps(lighter.to_dict()))["replicas"][0]["tokens"] == 6 * 4096


def test_the_engine_sizes_a_token_plan_s_batch_by_the_tokens_per_microbatch_it_learned() -> None:
    """A coordinator not told tokens_per_microbatch learns it from whole-share iterations (each
    micro-batch holds exactly that many), so a later token plan's batch is the job's 8
    micro-batches, not the sum of its replicas' counts (seen in a real job: "token shares sum
    to 1024, the global batch has 1280 tokens", and a needless re-plan)."""
    from types import SimpleNamespace

    from resihp.coordinator.model.trace import IterationRecord
    from resihp.coordinator.service.engine import build_header
    from resihp.coordinator.service.engine_real import RealEngine

    spec = preset("gpt-tiny")
    whole = Plan.uniform(1, 1, 2, spec.num_layers, 8)
    engine = RealEngine(build_header(spec, whole, 2, "job"))
    engine.observe(IterationRecord(0, 0.0, 1.0, (((60, 68),) * 4, ((128,),) * 4)), 1.0)
    tokens = Plan(replicas=(PipelinePlan(((0,),), (spec.num_layers,), 6, 640),
                            PipelinePlan(((1,),), (spec.num_layers,), 4, 384)), epoch=1)
    engine.set_plan(tokens, 1)
    engine.observe(IterationRecord(1, 1.0, 1.0, (((50, 60, 30),) * 6, ((96,),) * 4)), 2.0)
    seen: list[GlobalBatch] = []

    def fake_decide(cluster: object, model: object, batch: GlobalBatch, current: Plan, *rest: object,
                    **kw: object) -> object:
        seen.append(batch)
        return SimpleNamespace(act=False, plan=current, reason="kept", level="none")

    engine._planner = SimpleNamespace(decide=fake_decide)  # type: ignore[assignment]
    engine.decide(tokens, None, frozenset(), 3.0, {})
    assert seen and seen[0].microbatches == 8 and seen[0].tokens_per_microbatch == 128
    assert sum(seen[0].seqlens) <= 128  # a re-packed micro-batch's sample, trimmed to the batch's


def _searched_rate(cluster: Cluster, batch: GlobalBatch, config: PlannerConfig) -> tuple[float, Plan]:
    plan = Searcher(cluster, SPEC, batch, None, config).search().plan
    if not plan.document_shares:
        plan = document_shares(Costs(cluster, SPEC, batch, PlannerConfig()), plan) or plan
    return evaluate(plan, cluster, SPEC, batch, PlannerConfig()).tokens_per_s, plan


@pytest.mark.parametrize("nodes", [8, 16])
def test_search_ranks_shapes_by_their_document_shares(nodes: int) -> None:
    # one device of a TP8 x PP1 job lost: whole micro-batches split unevenly over the replicas
    # that are left (64 over 7 or 15), so a search that ranks shapes by whole shares prefers a
    # deeper layout that wastes devices but splits evenly; ranked by document shares, the
    # chosen layout keeps at least the devices of every whole node
    batch = GlobalBatch(64, 4096, (1024,) * 4)
    lost = Cluster.uniform(nodes, 8).with_failed([0])
    finer, plan = _searched_rate(lost, batch, PlannerConfig(document_shares=True))
    whole, _ = _searched_rate(lost, batch, PlannerConfig(document_shares=False))
    assert finer > whole * 1.01
    assert plan.document_shares and len(plan.ranks()) >= 8 * (nodes - 1)
    healthy, _ = _searched_rate(Cluster.uniform(nodes, 8), batch, PlannerConfig())
    assert finer / healthy > 0.92


def test_the_document_bound_never_exceeds_a_shape_s_time() -> None:
    # the search stops at the first shape whose lower bound exceeds the best time: a bound
    # above a shape's document-share time would skip it
    batch = GlobalBatch(64, 4096, (1024,) * 4)
    cluster = Cluster.uniform(4, 8).with_failed([0]).with_speeds({9: 0.5})
    searcher = Searcher(cluster, SPEC, batch, None, PlannerConfig())
    checked = 0
    for tp in (2, 4, 8):
        pool = searcher.pool(tp, "keep", 0, 1)
        for pp in (1, 2, 4, 5):
            for dp in searcher.dp_candidates(pool, pp):
                if not searcher.fits(pool, pp, dp):
                    continue
                res = searcher.evaluate_shape(pool, pp, dp, "concentrate", 0.0)
                if res is None or not math.isfinite(res.time_s):
                    continue
                assert searcher.lower_bound(pool, pp, dp) <= res.time_s * (1 + 1e-9), (tp, pp, dp)
                checked += 1
    assert checked >= 10
