"""Memory model: bytes per parameter, in-flight activations, what fits."""
from __future__ import annotations

import pytest

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.memory import (
    GiB,
    MemoryModel,
    inflight_microbatches,
    max_layers_fitting,
    stage_device_bytes,
)
from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.model.spec import SpecError, preset
from resihp.coordinator.planner.cost import Costs, device_layers
from resihp.coordinator.planner.planner import PlannerConfig, evaluate, search_plan


def test_mixed_precision_adamw_is_18_bytes_per_param() -> None:
    mem = MemoryModel()
    assert mem.state_bytes_per_param == 18.0
    assert mem.moved_bytes_per_param == 14.0  # gradients are not moved


def test_stage_bytes_by_hand() -> None:
    spec = preset("llama2-7b")
    mem = MemoryModel(reserve_bytes=0.0)
    got = stage_device_bytes(spec, mem, layers=4, tp=2, first=False, last=False, inflight=3, tokens=4096)
    want = 4 * spec.params_per_layer() * 18 / 2 + 3 * 4 * 34 * 4096 * spec.hidden / 2
    assert got == pytest.approx(want)
    first = stage_device_bytes(spec, mem, layers=4, tp=2, first=True, last=False, inflight=3, tokens=4096)
    assert first - got == pytest.approx(spec.embedding_params() * 18 / 2)


def test_recompute_keeps_only_layer_inputs() -> None:
    spec = preset("llama2-7b")
    assert MemoryModel(recompute=True).activation_bytes_per_layer(spec, 1000) == 2 * 1000 * spec.hidden


def test_inflight_1f1b_and_interleaved() -> None:
    assert [inflight_microbatches(Schedule.ONE_F_ONE_B, 4, s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches(Schedule.ONE_F_ONE_B, 4, 0, 2) == 2  # never more than the share
    assert inflight_microbatches(Schedule.ONE_F_ONE_B, 4, 0, 0) == 0
    # Megatron warm-up for stage 0 of p=4, v=2: 2·3 + 1·4 + 1 = 11 chunks of half a stage
    assert inflight_microbatches(Schedule.INTERLEAVED, 4, 0, 16, 2) == pytest.approx(5.5)


def test_max_layers_fitting_is_tight() -> None:
    spec = preset("llama2-13b")
    mem = MemoryModel()
    cap = 40 * GiB
    n = max_layers_fitting(spec, mem, capacity_bytes=cap, tp=2, first=False, last=False, inflight=4, tokens=4096)
    assert n > 0
    kw = dict(tp=2, first=False, last=False, inflight=4, tokens=4096)
    assert stage_device_bytes(spec, mem, layers=n, **kw) <= cap  # type: ignore[arg-type]
    assert stage_device_bytes(spec, mem, layers=n + 1, **kw) > cap  # type: ignore[arg-type]


def test_searched_plan_fits_every_device() -> None:
    spec = preset("llama2-13b")
    cluster = Cluster.uniform(4, 8, memory_bytes=24 * GiB)  # tight: forces deep pipelines / wide TP
    batch = GlobalBatch(16, 4096)
    cfg = PlannerConfig()
    plan = search_plan(cluster, spec, batch, None, cfg)
    costs = Costs(cluster, spec, batch, cfg)
    for rep in plan.replicas:
        per_dev = device_layers(rep.layers, rep.pp)
        for s, group in enumerate(rep.stages):
            need = costs.stage_bytes(len(group), per_dev[s], s == 0, s == rep.pp - 1,
                                     costs.inflight(rep.pp, s, rep.microbatches))
            assert need <= 24 * GiB
    assert evaluate(plan, cluster, spec, batch, cfg).feasible


def test_model_that_cannot_fit_is_rejected() -> None:
    cluster = Cluster.uniform(1, 2, memory_bytes=8 * GiB)
    with pytest.raises(SpecError, match="does not fit in memory"):
        search_plan(cluster, preset("llama2-70b"), GlobalBatch(4, 4096))
