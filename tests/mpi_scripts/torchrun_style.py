"""A torchrun-style script with resihp's two calls, for `resihp launch` tests.

    resihp launch -n 4 -- python tests/mpi_scripts/torchrun_style.py LOG [--steps N] [--fail-rank R]
        [--kill-rank R] [--model-kind module|preset|dict] [--with] [--no-own-pg] [--close]

Every rank appends JSON lines to LOG: its torchrun environment and the result of an all_reduce
over the group the script created itself (before init), then whether ``init`` reused that group.
It trains nothing real (a tiny module stands in for nanoGPT's GPT) and reports loss / tokens /
timed F and B spans; it never calls ``job.close()`` unless asked (the exit hook does).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import resihp.trainer_hooks as hooks


class Config:  # nanoGPT's GPTConfig names
    n_layer = 2
    n_head = 4
    n_embd = 32
    vocab_size = 256
    block_size = 16


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.lin = torch.nn.Linear(Config.n_embd, Config.n_embd)


def log(path: str, **fields: object) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--model-kind", default="module")
    p.add_argument("--with", dest="use_with", action="store_true")
    p.add_argument("--close", action="store_true")
    p.add_argument("--no-own-pg", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "RESIHP_RESTART_CMD", "RESIHP_MODEL")
    env = {k: os.environ.get(k) for k in names}
    rank = int(os.environ["RANK"])
    reduced = None
    group_before = None
    if not args.no_own_pg:
        dist.init_process_group("gloo")  # env://, as under torchrun
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        reduced = float(t.item())
        group_before = dist.group.WORLD
    log(args.log, event="env", env=env, all_reduce=reduced, dist_rank=dist.get_rank() if reduced else None)
    net = TinyGPT()
    model = {"module": net, "preset": "gpt-tiny",
             "dict": {"name": "d", "num_layers": 2, "hidden": 32, "num_heads": 4, "ffn_hidden": 128,
                      "vocab": 256}}[args.model_kind]
    job = hooks.init(model=model)
    log(args.log, event="init", rank=job.rank, world=job.world_size, reused=dist.group.WORLD is group_before,
        adopted=job.boot.adopted, spec=job.model.to_dict())
    with job if args.use_with else _nothing():
        for it in range(args.steps):
            if rank == args.fail_rank and it == 1:
                log(args.log, event="failing", rank=rank)
                sys.exit(1)
            if rank == args.kill_rank and it == 1:
                log(args.log, event="killing", rank=rank)
                os.kill(os.getpid(), signal.SIGKILL)
            for _mb in range(2):
                with job.timed("F"):
                    loss = net.lin(torch.ones(4, Config.n_embd)).pow(2).mean()
                with job.timed("B"):
                    loss.backward()
            x = torch.tensor([1.0])
            dist.all_reduce(x)  # a synchronous step: every rank waits for the slowest
            job.step(loss=loss.detach(), tokens=4 * Config.block_size * job.world_size,
                     seqlens=[[Config.block_size]] * 4)
        log(args.log, event="trained", rank=rank, plan=job.plan.describe(),
            global_microbatches=job.plan.global_microbatches)
        if args.close:
            job.close()
    log(args.log, event="leaving", rank=rank, time=time.time())
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
