"""An ordinary GPT training loop on real text, with resihp's two calls added.

    mpirun --allow-run-as-root --oversubscribe -n 8 .venv/bin/python examples/train_gpt.py \
        --tp 2 --pp 2 --dp 2 --steps 50
    resihp launch -n 8 --tp 2 --pp 2 --dp 2 --microbatches 8 -- python examples/train_gpt.py --tp 2 --pp 2 --dp 2

Data: the Python standard library's sources as byte-level documents, packed into
micro-batches of --seq tokens (8K-style packing scaled down to a CPU).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

import torch

import resihp.trainer_hooks as hooks
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.checkpoint.saver import AsyncCheckpointer, latest_checkpoint, load_into
from resihp.trainer_hooks.model_source import resolve_model
from resihp.trainer_hooks.runtime.autolayout import AutoLayout
from resihp.trainer_hooks.runtime.progress_log import loss_rank
from resihp.trainer_hooks.runtime.recovery import JobStopped
from resihp.trainer_hooks.runtime.trainer import TrainConfig
from resihp.trainer_hooks.usermodel.example_cli import layout_option


def build_plan(args: argparse.Namespace, spec: ModelSpec) -> Plan | AutoLayout:
    if args.layout == "auto":
        return AutoLayout(microbatches=args.microbatches)  # timed on this job's ranks at init
    if not args.shares:
        return Plan.uniform(args.tp, args.pp, args.dp, spec.num_layers, args.microbatches)
    shares = [int(s) for s in args.shares.split(",")]
    if len(shares) != args.dp:
        raise SpecError(f"--shares lists {len(shares)} values but --dp is {args.dp}")
    base = Plan.uniform(args.tp, args.pp, args.dp, spec.num_layers, sum(shares))
    reps = tuple(PipelinePlan(r.stages, r.layers, s) for r, s in zip(base.replicas, shares))
    return Plan(replicas=reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    layout_option(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="gpt-tiny", help="a ModelSpec preset or a JSON/YAML file of one (default gpt-tiny)")
    p.add_argument("--seq", type=int, default=128, help="tokens per packed micro-batch (and max positions)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--shares", default="", help="micro-batches per DP replica, e.g. 3,5 (default: even)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--compute-clock", choices=("wall", "cpu", "auto"), default="wall",
                   help="how compute ops are timed: wall (CUDA events on a GPU), cpu (the thread's CPU time), "
                        "auto (cpu on a CPU, CUDA events on a GPU)")
    p.add_argument("--trace", default=None, help="write the run's trace here (default $RESIHP_TRACE)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-dir", default="", help="save checkpoints here (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="save after every K-th step")
    p.add_argument("--resume", action="store_true", help="start from the latest complete checkpoint, if any")
    p.add_argument("--no-resilience", action="store_true", help="a peer failure crashes the rank (no recovery)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    spec = resolve_model(args.model)
    plan = build_plan(args, spec)

    job = hooks.init(spec, plan, config=TrainConfig(seed=args.seed, max_seq_len=args.seq, lr=args.lr,
                                                compute_clock=args.compute_clock),
                     trace=args.trace, resilient=False if args.no_resilience else None,
                     checkpoint_dir=args.checkpoint_dir or None)  # resihp call 1
    ckpt = AsyncCheckpointer(args.checkpoint_dir, job.rank, spec, job.config) if args.checkpoint_dir else None
    resume_step = 0
    if args.resume and args.checkpoint_dir and (path := latest_checkpoint(args.checkpoint_dir)) is not None:
        resume_step = load_into(job.runtime, job.plan, job.rank, path)  # any layout; the data follow the step
    tokens = 0
    start = time.perf_counter()
    try:
        for it in job.iterations(args.steps, start=resume_step):  # rewinds after a fail-stop; an excluded rank waits here
            result = job.train_step(it)  # this rank's 1F1B step; None if a peer died and the job recovered
            outcome = job.step(result)  # resihp call 2: report, apply commands at the step boundary
            if result is None:
                continue
            if ckpt is not None:
                ckpt.maybe_save(it, job.runtime, job.plan, every=args.checkpoint_every)  # a snapshot; written async
            tokens += result.global_tokens
            if result.loss is not None and job.rank == loss_rank(job.plan) and (
                    it % args.log_every == 0 or it == args.steps - 1):
                rate = tokens / (time.perf_counter() - start)
                print(f"step {it:4d}  loss {result.loss:.4f}  tokens/s {rate:8.0f}  epoch {job.epoch}  "
                      f"{job.plan.describe()}", flush=True)
            if outcome.stop:
                break
    except JobStopped as exc:  # no layout of the survivors can go on: say so and leave (MPI is broken)
        print(f"rank {job.rank}: the job stopped: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    failed = job.resilience is not None and job.resilience.failures > 0
    if ckpt is not None:
        ckpt.close()
    job.close()
    if failed:  # MPI finalisation can hang once a rank has died: leave without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - e.g. a peer died before the job was resilient (start-up)
        # leave at once: MPI's finalisation would wait for the dead peer, and the launcher only
        # ends the job once no rank is left
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
