"""What the your-own-model examples (examples/nanogpt/train_resilient.py, examples/llama/train.py)
share around their training loops: the command line, the plan, and leaving after a failure."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.checkpoint.saver import AsyncCheckpointer
from resihp.trainer_hooks.runtime.trainer import TrainConfig


def parse(doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=64, help="tokens per micro-batch (one row)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--losses", default="", help="write the losses of every step here (JSON lines)")
    p.add_argument("--checkpoint-dir", default="", help="save layout-free checkpoints here (default: none); a "
                   "fail-stop no surviving replica can serve recovers from the latest")
    p.add_argument("--checkpoint-every", type=int, default=5, help="save after every K-th step")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    return args


def plan_and_config(args: argparse.Namespace) -> tuple[Plan, TrainConfig]:
    plan = Plan.uniform(args.tp, args.pp, args.dp, args.layers, args.microbatches)
    return plan, TrainConfig(seed=args.seed, max_seq_len=args.seq, lr=args.lr)


def checkpointer(job: Any, args: argparse.Namespace) -> AsyncCheckpointer | None:
    """Asynchronous checkpoints of the user's model, by its own parameter names (any layout loads them)."""
    if not args.checkpoint_dir:
        return None
    recipe = job.runtime.recipe if job.runtime is not None else None
    return AsyncCheckpointer(args.checkpoint_dir, job.rank, job.model, job.config,
                             layout=recipe.layout() if recipe is not None else None)


def leave(failed: bool, code: int = 0) -> None:
    """After a rank died MPI's finalisation can hang: leave without it."""
    if failed or code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
