"""A stage module built ahead of a switch (pending TP group), bound later; old groups retired off-thread."""
from __future__ import annotations

import threading

import pytest
import torch

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.runtime.groups import place_of, retire
from resihp.trainer_hooks.runtime.model import Block
from resihp.trainer_hooks.runtime.tp_layers import TPContext, bind_tp, pending_tp
from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig, build_stage, build_stage_ahead

SPEC = ModelSpec("unit", num_layers=4, hidden=32, num_heads=4, ffn_hidden=64, vocab=256)
CONFIG = TrainConfig(seed=3, max_seq_len=64, lr=1e-3)


def test_a_pending_tp_place_is_sized_but_has_no_usable_group() -> None:
    tp = pending_tp(1, 4)
    assert (tp.index, tp.size) == (1, 4)
    assert "not bound" in repr(tp.group)
    assert pending_tp(0, 1).group is None  # a group of one needs none


def test_a_stage_built_ahead_has_the_places_shapes_and_takes_its_group_later() -> None:
    plan = Plan.uniform(2, 2, 1, SPEC.num_layers, 4)
    place = place_of(plan, 3)  # stage 1, TP index 1 of 2
    stage = build_stage(SPEC, CONFIG.max_seq_len, place)
    assert stage.layer_range == (2, 4) and stage.last and not stage.first
    block = stage.layers["2"]
    assert isinstance(block, Block)
    assert block.attn.qkv.weight.shape == (3 * 32 // 2, 32)  # column-parallel half
    assert block.mlp.fc2.weight.shape == (32, 64 // 2)  # row-parallel half
    real = TPContext(group=object(), index=1, size=2)
    bind_tp(stage, real)
    assert all(m.tp is real for m in stage.modules() if hasattr(m, "tp"))
    with pytest.raises(ValueError, match="built for TP place 1/2 cannot take place 0/2"):
        bind_tp(stage, TPContext(group=object(), index=0, size=2))


def test_runtime_adopts_a_module_built_ahead_and_trains_like_a_fresh_one(world1: None) -> None:
    plan = Plan.uniform(1, 1, 1, SPEC.num_layers, 2)
    fresh = Runtime(SPEC, plan, 0, CONFIG)
    ahead = Runtime(SPEC, plan, 0, CONFIG, model=build_stage(SPEC, CONFIG.max_seq_len, place_of(plan, 0)),
                    init_weights=False)
    with torch.no_grad():
        for name, p in ahead.model.named_parameters():
            p.copy_(fresh.shards()[name])
    assert fresh.train_step(0).loss == pytest.approx(ahead.train_step(0).loss, rel=1e-6)


def test_runtime_takes_a_stage_ahead_with_its_table_and_adamw_and_trains_like_a_fresh_one(world1: None) -> None:
    plan = Plan.uniform(1, 1, 1, SPEC.num_layers, 2)
    fresh = Runtime(SPEC, plan, 0, CONFIG)
    parts = build_stage_ahead(SPEC, CONFIG, place_of(plan, 0))
    assert list(parts.params) == [n for n, _ in parts.model.named_parameters()]
    assert len(parts.tp_modules) == 4 * SPEC.num_layers + 1  # qkv, proj, fc1, fc2 of every layer; the stage
    ahead = Runtime(SPEC, plan, 0, CONFIG, model=parts, init_weights=False)
    assert ahead.model is parts.model and ahead.optimizer is parts.optimizer and ahead.parameters() is parts.params
    assert all(m.tp is ahead.groups.tp for m in parts.tp_modules)
    with torch.no_grad():
        for name, p in ahead.parameters().items():
            p.copy_(fresh.shards()[name])
    # two steps: the second one runs on the AdamW moments the first one left in the ahead optimizer
    for step in (0, 1):
        assert fresh.train_step(step).loss == pytest.approx(ahead.train_step(step).loss, rel=1e-6)
    assert all(torch.equal(ahead.shards()[n], t) for n, t in fresh.shards().items())


def test_runtime_refuses_a_module_built_for_another_place(world1: None) -> None:
    plan = Plan.uniform(1, 1, 1, SPEC.num_layers, 2)
    other = build_stage(SPEC, CONFIG.max_seq_len, place_of(Plan.uniform(1, 2, 1, SPEC.num_layers, 2), 0))
    with pytest.raises(SpecError, match=r"holds layers \(0, 2\).*needs \(\(0, 4\), True, True\)"):
        Runtime(SPEC, plan, 0, CONFIG, model=other, init_weights=False)


def test_retire_drops_the_last_reference_on_another_thread() -> None:
    done = threading.Event()
    where: list[str] = []

    class Held:
        def __del__(self) -> None:
            where.append(threading.current_thread().name)
            done.set()

    obj = Held()
    retire(obj)
    del obj
    assert done.wait(10.0)
    assert where == ["resihp-retire"]
