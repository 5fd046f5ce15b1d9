"""What the your-own-model examples (examples/nanogpt/train_resilient.py, examples/llama/train.py)
share around their training loops: the command line, the plan, and leaving after a failure."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.checkpoint.saver import AsyncCheckpointer
from resihp.trainer_hooks.runtime.autolayout import LAYOUT_ENV, AutoLayout
from resihp.trainer_hooks.runtime.trainer import TrainConfig


def parse(doc: str, argv: list[str] | None = None,
          own: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The examples' options; ``own`` adds an example's own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if own is not None:
        own(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    layout_option(p)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=64, help="tokens per micro-batch (one row)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw (the runtime's) or sgd (torch.optim.SGD, momentum 0.9: its momentum buffers are "
                        "resharded like AdamW's moments)")
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


def layout_option(p: argparse.ArgumentParser) -> None:
    """``--layout fixed|auto``; its default is auto under ``resihp launch --layout auto``."""
    p.add_argument("--layout", choices=("fixed", "auto"),
                   default="auto" if os.environ.get(LAYOUT_ENV, "").strip() == "auto" else "fixed",
                   help="fixed: --tp/--pp/--dp; auto: time the healthy layouts of the job's ranks and train on the "
                        "fastest (the default under resihp launch --layout auto)")


def plan_and_config(args: argparse.Namespace) -> tuple[Plan | AutoLayout, TrainConfig]:
    plan: Plan | AutoLayout = (AutoLayout(microbatches=args.microbatches) if args.layout == "auto"
                               else Plan.uniform(args.tp, args.pp, args.dp, args.layers, args.microbatches))
    return plan, TrainConfig(seed=args.seed, max_seq_len=args.seq, lr=args.lr)


def sgd_momentum(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The examples' ``--optimizer sgd``: a torch optimizer whose state (momentum) is not AdamW's."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def optimizer(args: argparse.Namespace) -> Any:
    """``init``'s ``optimizer=``: None (AdamW) or the SGD factory."""
    return sgd_momentum if args.optimizer == "sgd" else None


class StepLog:
    """The examples' side work per step: layout-free checkpoints (``--checkpoint-dir``, by the
    model's own parameter names: any layout loads them), the loss printed every --log-every
    steps and written to ``--losses``, by the one rank that holds it."""

    def __init__(self, job: Any, args: argparse.Namespace) -> None:
        self.job, self.args = job, args
        recipe = job.runtime.recipe if job.runtime is not None else None
        self.ckpt = AsyncCheckpointer(args.checkpoint_dir, job.rank, job.model, job.config,
                                      layout=recipe.layout() if recipe is not None else None) if args.checkpoint_dir else None
        self.out = open(args.losses, "a") if args.losses else None  # noqa: SIM115 - closed in close()

    def after(self, it: int, result: Any) -> None:
        job, args = self.job, self.args
        if result is None:  # a peer died and the job recovered: iterations() resumes at the agreed step
            return
        if self.ckpt is not None:
            self.ckpt.maybe_save(it, job.runtime, job.plan, every=args.checkpoint_every)
        runtime = job.runtime  # None once the step's command made this rank a spare
        if result.loss is None or result.replica != 0 or runtime is None or runtime.groups.place.tp_index != 0:
            return
        if self.out is not None:
            self.out.write(json.dumps({"step": it, "loss": result.loss, "epoch": job.epoch}) + "\n")
            self.out.flush()
        if it % args.log_every == 0 or it == args.steps - 1:
            print(f"step {it:4d}  loss {result.loss:.4f}  epoch {job.epoch}  {job.plan.describe()}", flush=True)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.out is not None:
            self.out.close()


def finish(job: Any, log: StepLog, stopped: BaseException | None = None) -> None:
    """Close the job and leave; after a rank died, without MPI's finalisation (it can hang)."""
    log.close()
    if stopped is not None:  # no layout of the survivors can go on (JobStopped): say so and leave
        print(f"rank {job.rank}: the job stopped: {stopped}", file=sys.stderr, flush=True)
        leave(True, 3)
    failed = job.resilience is not None and job.resilience.failures > 0
    job.close()
    leave(failed)


def leave(failed: bool, code: int = 0) -> None:
    """After a rank died MPI's finalisation can hang: leave without it."""
    if failed or code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
