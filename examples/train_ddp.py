"""A plain torch DistributedDataParallel loop with resihp's two calls: reporting and detection
for a job whose model resihp does not place (it can observe, not reshape, such a job).

    resihp launch -n 4 -- .venv/bin/python examples/train_ddp.py --steps 20

The script starts like any torchrun script (``init_process_group`` from the RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT that ``resihp launch`` sets); ``init`` reuses that group.
``job.timed`` records this rank's own forward and backward spans: in a synchronous DDP step
every rank's step takes the same time, and only these spans say which rank is slow. ``close``
runs by itself at exit.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resihp.trainer_hooks as hooks
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.trainer_hooks.runtime.data import GlobalBatches, PackedStream
from resihp.trainer_hooks.runtime.model import GPTStage, PackedMeta, loss_sum
from resihp.trainer_hooks.runtime.trainer import TrainConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--trace", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    spec = preset(args.model)

    if "RANK" in os.environ and not dist.is_initialized():  # torchrun / `resihp launch`: env:// rendezvous
        dist.init_process_group("gloo")
    # resihp call 1: reuses that group (else MPI → torch.distributed), agent connection; no plan =
    # the loop keeps its model; micro-batches per rank are learned from the first step
    job = hooks.init(spec, config=TrainConfig(seed=args.seed, max_seq_len=args.seq), trace=args.trace)
    device = job.boot.device
    net = GPTStage(spec, args.seq, (0, spec.num_layers), first=True, last=True)
    net.init_from_seed(args.seed)
    model = DDP(net.to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    layout = Plan.uniform(1, 1, job.world_size, spec.num_layers, job.world_size * args.microbatches)
    batches = GlobalBatches(PackedStream(args.seq, seed=args.seed), layout.global_microbatches)
    start = time.perf_counter()
    for it in range(args.steps):
        batch = batches.for_replica(it, layout, job.rank)  # this rank's share of global batch `it`
        tokens = sum(mb.num_tokens for mb in batch.microbatches)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(batch.microbatches):
            sync = contextlib.nullcontext() if i == len(batch.microbatches) - 1 else model.no_sync()
            with sync:
                with job.timed("F"):  # this rank's own compute, micro-batch i
                    logits = model(mb.tokens.to(device), PackedMeta.from_seqlens(mb.seqlens, device))
                    loss = loss_sum(logits, mb.targets.to(device)) / tokens
                with job.timed("B"):
                    loss.backward()
            total += float(loss.detach())
        with job.timed("OPT"):
            opt.step()
        # resihp call 2: this rank's packed sequence lengths (a plain (B, T) batch: [[T]] * B per
        # micro-batch), the loss and the step's tokens over all ranks for progress.jsonl
        outcome = job.step(iteration=it, seqlens=batch.seqlens, loss=total, tokens=batch.global_tokens)
        if job.rank == 0 and it % 5 == 0:
            rate = batch.global_tokens * (it + 1) / (time.perf_counter() - start)
            print(f"step {it:4d}  rank-0 loss {total:.4f}  tokens/s {rate:8.0f}", flush=True)
        if outcome.stop:
            break
    return 0  # job.close() runs at exit


if __name__ == "__main__":
    sys.exit(main())
