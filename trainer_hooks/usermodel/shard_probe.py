"""Which replicated modules of a block see a TP shard of the activations?

A module the TP plan does not split, with parameters of its own, that runs on a split
activation — a per-head norm, a learnable activation between the column- and the
row-parallel layer — gets a partial gradient on each TP rank, whether its plan declares it
(``replicated_with_grad_allreduce``) or not (Apertus's xIELU ``act_fn``). Such modules are
found from the shapes they are called with: block 0 is run on the meta device unsplit and
split, and every module whose inputs change shape is one. Their gradients are then summed
over the TP group (``tp_layers.sum_grad_over_tp``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from resihp.trainer_hooks.usermodel.spec import LayoutSpec

# (TP size) -> (a meta stage of block 0 with both ends, a row of tokens, its PackedMeta)
MetaStage = Callable[[int], tuple[nn.Module, torch.Tensor, Any]]


def modules_seeing_a_shard(meta_stage: MetaStage, ls: LayoutSpec, tp: int) -> tuple[str, ...]:
    """Block-relative paths of the modules with parameters, outside the TP plan, whose inputs
    differ in shape under TP ``tp`` from unsplit; () where the block cannot run split (the
    recipe's ``validate`` says why)."""
    split = set(ls.styles())
    seen: dict[int, dict[str, list[tuple[int, ...]]]] = {}
    for size in (1, tp):
        shapes = seen[size] = {}
        stage, tokens, meta = meta_stage(size)
        block = stage.get_submodule(f"{ls.blocks}.0")
        handles = []
        for path, mod in block.named_modules():
            if path in split or not list(mod.parameters(recurse=False)):
                continue

            def record(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path,
                       shapes: dict[str, list[tuple[int, ...]]] = shapes) -> None:
                shapes.setdefault(path, []).extend(
                    tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            handles.append(mod.register_forward_pre_hook(record, with_kwargs=True))
        try:
            with torch.device("meta"):
                stage(tokens, meta)
        except Exception:  # noqa: BLE001 - a block that cannot run split: validate names it
            return ()
        finally:
            for h in handles:
                h.remove()
    return tuple(sorted(p for p in seen[1] if seen[tp].get(p) != seen[1][p]))
