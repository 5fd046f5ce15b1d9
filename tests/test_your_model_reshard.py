"""A user's model resharded between every pair of layouts TP ∈ {1,2,4} × PP ∈ {1,2,4}, bit-exact.

For nanoGPT (tied embedding / LM head, fused q,k,v) and a Hugging Face Llama (GQA, SwiGLU), the
old shards are the parameters of real stage modules built for the old layout; the reshard
planner's transfers are applied piece by piece; every new shard must equal, bit for bit, the
parameter of the stage module built for the new layout (a path that shares nothing with the
reshard), and AdamW's two moments their full tensors sliced the same way.
"""
from __future__ import annotations

import itertools
import zlib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from usermodel_models import HF_FAMILIES, LAYERS, MODELS, recipe

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.reconfig.reshard import STATES, plan_reshard
from resihp.trainer_hooks.runtime.groups import place_of
from resihp.trainer_hooks.runtime.layout import tensors_of_rank
from resihp.trainer_hooks.runtime.tp_layers import pending_tp
from resihp.trainer_hooks.runtime.trainer import stage_parameters

LAYOUTS = list(itertools.product((1, 2, 4), (1, 2, 4)))  # (tp, pp)
WORLD = 16


def plan(tp: int, pp: int, reverse: bool) -> Plan:
    ranks = list(range(tp * pp))
    return Plan.uniform(tp, pp, 1, LAYERS, 4, ranks=ranks[::-1] if reverse else ranks)


@cache
def _recipe(model: str):  # type: ignore[no-untyped-def]
    return recipe(model)


@cache
def stage_params(model: str, tp: int, pp: int, reverse: bool, rank: int) -> dict[str, torch.Tensor]:
    place = place_of(plan(tp, pp, reverse), rank)
    stage = _recipe(model).build_stage(place.layer_range, place.first, place.last,
                                       pending_tp(place.tp_index, place.tp_size))
    return {n: p.detach().clone() for n, p in stage_parameters(stage).items()}


@cache
def moment(model: str, name: str, state: str) -> torch.Tensor:
    spec = next(s for s in _recipe(model).layout().tensor_specs() if s.name == name)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{state}".encode()))
    return torch.randn(spec.shape, generator=gen)


def shards(model: str, tp: int, pp: int, reverse: bool) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    p = plan(tp, pp, reverse)
    specs = _recipe(model).layout().tensor_specs()
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for rank in p.ranks():
        params = stage_params(model, tp, pp, reverse, rank)
        held = {spec.name: idx for spec, idx in tensors_of_rank(p, rank, specs)}
        assert set(held) == set(params), "the stage module holds exactly the layout's tensors of its place"
        for name, idx in held.items():  # and each is its slice of the user's unsharded model
            assert torch.equal(params[name], _recipe(model).full_tensor(name)[idx]), f"{model} rank {rank} {name}"
        out[rank] = {"param": params}
        for state in STATES[1:]:
            out[rank][state] = {n: moment(model, n, state)[idx].clone() for n, idx in held.items()}
    return out


@pytest.mark.parametrize("model", MODELS + HF_FAMILIES)
def test_every_layout_pair_reshards_parameters_and_adamw_state_bit_exact(model: str) -> None:
    specs = _recipe(model).layout().tensor_specs()
    checked = 0
    for (tp_a, pp_a), (tp_b, pp_b) in itertools.product(LAYOUTS, LAYOUTS):
        old_plan, new_plan = plan(tp_a, pp_a, False), plan(tp_b, pp_b, True)
        old = shards(model, tp_a, pp_a, False)
        rplan = plan_reshard(old_plan, new_plan, specs, range(WORLD))
        new: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for rank in new_plan.ranks():
            new[rank] = {s: {spec.name: torch.full(tuple(i.stop - i.start for i in idx), float("nan"))
                             for spec, idx in tensors_of_rank(new_plan, rank, specs)} for s in STATES}
        for t in rplan.transfers:
            new[t.dst][t.state][t.name][t.dst_index] = old[t.src][t.state][t.name][t.src_index]
        want = shards(model, tp_b, pp_b, True)
        for rank, states in want.items():
            for state, tensors in states.items():
                for name, value in tensors.items():
                    got = new[rank][state][name]
                    assert got.shape == value.shape and torch.equal(got.view(torch.int32), value.view(torch.int32)), (
                        f"{model}: TP{tp_a}xPP{pp_a} -> TP{tp_b}xPP{pp_b}: rank {rank} {state} of {name}")
                    checked += 1
    assert checked > 81 * 3 * 10


class _Held:
    """What the checkpointer reads from a runtime: one rank's shards and AdamW state."""

    def __init__(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.states = states

    def shards(self) -> dict[str, torch.Tensor]:
        return self.states["param"]

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        return {n: {"step": torch.tensor(7.0), "exp_avg": self.states["exp_avg"][n],
                    "exp_avg_sq": self.states["exp_avg_sq"][n]} for n in self.states["param"]}


@pytest.mark.parametrize("model", MODELS)
def test_a_checkpoint_of_one_layout_loads_into_another_by_the_model_s_names(model: str, tmp_path: Path) -> None:
    """Layout-free checkpoints of a user's model: saved by the ranks of TP2 x PP2, read back by
    the ranks of TP4 x PP1 (reversed) and of TP1 x PP4, bit-exact against their stage modules."""
    from resihp.trainer_hooks.checkpoint.saver import AsyncCheckpointer, latest_checkpoint, shards_for
    from resihp.trainer_hooks.runtime.trainer import TrainConfig

    r = _recipe(model)
    config = TrainConfig(max_seq_len=32)
    old_plan = plan(2, 2, False)
    held = shards(model, 2, 2, False)
    cps = [AsyncCheckpointer(tmp_path, rank, r.spec, config, run_id="t", fsync=False, layout=r.layout())
           for rank in old_plan.ranks()]
    for cp in cps:
        cp.save(6, _Held(held[cp.rank]), old_plan)  # type: ignore[arg-type]
    for cp in cps:
        cp.close(30)
    path = latest_checkpoint(tmp_path)
    assert path is not None
    for tp, pp, reverse in ((4, 1, True), (1, 4, False)):
        want = shards(model, tp, pp, reverse)
        for rank in plan(tp, pp, reverse).ranks():
            got, adam, resume = shards_for(path, plan(tp, pp, reverse), rank, r.spec, 32, layout=r.layout())
            assert (adam, resume) == (7.0, 7)
            for state, tensors in want[rank].items():
                assert sorted(got[state]) == sorted(tensors)
                for name, value in tensors.items():
                    assert torch.equal(got[state][name], value), (model, tp, pp, rank, state, name)
