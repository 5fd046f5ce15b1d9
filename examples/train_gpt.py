"""An ordinary GPT training loop on real text, with resihp's two calls added.

    mpirun --allow-run-as-root --oversubscribe -n 8 .venv/bin/python examples/train_gpt.py \
        --tp 2 --pp 2 --dp 2 --steps 50
    resihp launch -n 8 --tp 2 --pp 2 --dp 2 -- python examples/train_gpt.py --tp 2 --pp 2 --dp 2

Data: the Python standard library's sources as byte-level documents, packed into
micro-batches of --seq tokens (8K-style packing scaled down to a CPU).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

import resihp.trainer_hooks as hooks
from resihp.coordinator.plan import PipelinePlan, Plan
from resihp.coordinator.spec import ModelSpec, SpecError, preset
from resihp.trainer_hooks.runtime import TrainConfig


def build_plan(args: argparse.Namespace, spec: ModelSpec) -> Plan:
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="gpt-tiny", help="a ModelSpec preset (default gpt-tiny)")
    p.add_argument("--seq", type=int, default=128, help="tokens per packed micro-batch (and max positions)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--shares", default="", help="micro-batches per DP replica, e.g. 3,5 (default: even)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--trace", default=None, help="write the run's trace here (default $RESIHP_TRACE)")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    spec = preset(args.model)
    plan = build_plan(args, spec)

    job = hooks.init(spec, plan, config=TrainConfig(seed=args.seed, max_seq_len=args.seq, lr=args.lr),
                     trace=args.trace)  # resihp call 1
    rt = job.runtime
    assert rt is not None
    report_rank = plan.replicas[0].stages[-1][0]  # holds the loss
    tokens = 0
    start = time.perf_counter()
    for it in range(args.steps):
        result = rt.train_step(it)
        tokens += result.global_tokens
        outcome = job.step(result)  # resihp call 2
        if job.rank == report_rank and (it % args.log_every == 0 or it == args.steps - 1):
            rate = tokens / (time.perf_counter() - start)
            print(f"step {it:4d}  loss {result.loss:.4f}  tokens/s {rate:8.0f}  epoch {job.epoch}", flush=True)
        if outcome.stop:
            break
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
