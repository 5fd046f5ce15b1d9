"""A plain torch DistributedDataParallel loop with resihp's two calls: reporting and detection
for a job whose model resihp does not place (it can observe, not reshape, such a job).

    mpirun --allow-run-as-root --oversubscribe -n 4 .venv/bin/python examples/train_ddp.py --steps 20
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import resihp.trainer_hooks as hooks
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

    # resihp call 1: MPI → torch.distributed (gloo / NCCL), agent connection; no plan = the loop keeps its model
    job = hooks.init(spec, config=TrainConfig(seed=args.seed, max_seq_len=args.seq),
                     microbatches_per_rank=args.microbatches, trace=args.trace)
    device = job.boot.device
    net = GPTStage(spec, args.seq, (0, spec.num_layers), first=True, last=True)
    net.init_from_seed(args.seed)
    model = DDP(net.to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = GlobalBatches(PackedStream(args.seq, seed=args.seed), job.plan.global_microbatches)
    start = time.perf_counter()
    for it in range(args.steps):
        batch = batches.for_replica(it, job.plan, job.rank)  # this rank's share of global batch `it`
        tokens = sum(mb.num_tokens for mb in batch.microbatches)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(batch.microbatches):
            sync = contextlib.nullcontext() if i == len(batch.microbatches) - 1 else model.no_sync()
            with sync:
                logits = model(mb.tokens.to(device), PackedMeta.from_seqlens(mb.seqlens, device))
                loss = loss_sum(logits, mb.targets.to(device)) / tokens
                loss.backward()
            total += float(loss)
        opt.step()
        outcome = job.step(iteration=it, seqlens=batch.seqlens)  # resihp call 2
        if job.rank == 0 and it % 5 == 0:
            rate = batch.global_tokens * (it + 1) / (time.perf_counter() - start)
            print(f"step {it:4d}  rank-0 loss {total:.4f}  tokens/s {rate:8.0f}", flush=True)
        if outcome.stop:
            break
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
