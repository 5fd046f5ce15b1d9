"""One rank of the your-own-model TP test: a stage of the whole model split over TP 2 (gloo), its
forward and backward against the user's unsharded model in the same process.

Usage: _usermodel_tp_worker.py RANK WORLD STORE_PORT MODEL OUT_JSON. Writes the largest
difference of the logits, the loss and every gradient (each rank's shard against the same
slice of the unsharded model's gradient).
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from usermodel_models import SEQ, recipe

from resihp.trainer_hooks.runtime.layout import shard_slice
from resihp.trainer_hooks.runtime.model import PackedMeta, loss_sum
from resihp.trainer_hooks.runtime.tp_layers import TPContext
from resihp.trainer_hooks.runtime.trainer import stage_parameters


def reference_logits(model: torch.nn.Module, name: str, tokens: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """The user's own forward: nanoGPT on the whole row; Llama on each document alone (the
    packed stage must equal separate sequences)."""
    if name == "nanogpt":
        logits, _ = model(tokens[None], targets=tokens[None])
        return logits[0]
    parts, start = [], 0
    for n in seqlens:
        parts.append(model(input_ids=tokens[None, start:start + n]).logits[0])
        start += n
    return torch.cat(parts)


def main() -> None:
    rank, world, port, name, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))  # pyright: ignore[reportPrivateImportUsage]  # public, not re-exported in its stub
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    r = recipe(name)
    full = r.template()
    tokens = torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(7))
    targets = torch.roll(tokens, -1)
    seqlens = [SEQ] if name == "nanogpt" else [20, SEQ - 20]
    stage = r.build_stage((0, r.num_layers), True, True, TPContext(dist.group.WORLD, rank, world))
    logits = stage(tokens, PackedMeta.from_seqlens(seqlens))
    loss = loss_sum(logits, targets) / SEQ
    loss.backward()
    ref_logits = reference_logits(full, name, tokens, seqlens)
    ref_loss = F.cross_entropy(ref_logits.float(), targets, reduction="sum") / SEQ
    ref_loss.backward()
    specs = {s.name: s for s in r.layout().tensor_specs()}
    grad_diff: dict[str, float] = {}
    for pname, p in stage_parameters(stage).items():
        spec = specs[pname]
        ref = full.get_parameter(pname).grad
        assert p.grad is not None and ref is not None, pname
        ref = ref.reshape(spec.shape)  # a fused layer's logical shape
        want = ref[shard_slice(spec, rank, world)]
        grad_diff[pname] = float((p.grad - want).abs().max()) / max(float(want.abs().max()), 1e-12)
    json.dump({"logits": float((logits - ref_logits).abs().max()), "loss": abs(float(loss) - float(ref_loss)),
               "grad_rel": grad_diff, "split": sorted(n for n, s in specs.items() if s.tp_dim is not None)},
              open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
