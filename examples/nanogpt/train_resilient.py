"""nanoGPT's model, trained hybrid-parallel and resilient: an ordinary loop plus resihp's two calls.

    resihp launch -n 8 --tp 2 --pp 2 --dp 2 -- python examples/nanogpt/train_resilient.py --tp 2 --pp 2 --dp 2

resihp builds the model from ``model.py``, cuts it into pipeline stages, shards its blocks by
the TP plan in ``layout.py`` and, when a rank slows down or dies, re-plans and reshards it
(parameters and AdamW state) while training goes on. Data: the Python standard library's
sources as byte-level rows of --seq tokens (the model has no document masking: a row is one
sequence to it).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py and layout.py lie beside this file

from layout import NANOGPT_LAYOUT  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import resihp.trainer_hooks as resihp_hooks  # noqa: E402
from resihp.trainer_hooks.runtime.recovery import JobStopped  # noqa: E402
from resihp.trainer_hooks.usermodel.example_cli import StepLog, finish, optimizer, parse, plan_and_config  # noqa: E402


def main() -> None:
    args = parse(__doc__ or "")
    plan, config = plan_and_config(args)
    cfg = GPTConfig(block_size=args.seq, vocab_size=256, n_layer=args.layers, n_head=4, n_embd=64, dropout=0.0,
                    bias=True)
    job = resihp_hooks.init(lambda: GPT(cfg), plan, layout=NANOGPT_LAYOUT, config=config,
                            checkpoint_dir=args.checkpoint_dir or None, optimizer=optimizer(args))  # resihp call 1
    log = StepLog(job, args)  # optional side work: checkpoints, loss lines
    try:
        for it in job.iterations(args.steps):  # rewinds after a fail-stop; a spare waits here
            result = job.train_step(it)  # this rank's pipeline step; None if a peer died and the job recovered
            job.step(result)  # resihp call 2: report, apply re-plans at the step boundary
            log.after(it, result)
    except JobStopped as exc:
        finish(job, log, exc)
    finish(job, log)


if __name__ == "__main__":
    main()
