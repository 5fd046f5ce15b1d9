"""A Hugging Face ``LlamaForCausalLM`` (tiny, random: nothing is downloaded), trained hybrid-parallel
and resilient: an ordinary loop plus resihp's two calls, and no layout spec — the model declares
its own TP and pipeline plans (``base_model_tp_plan`` / ``base_model_pp_plan``).

    resihp launch -n 8 --tp 2 --pp 2 --dp 2 -- python examples/llama/train.py --tp 2 --pp 2 --dp 2

GQA (4 heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU. Data: the Python standard library's
sources as byte-level documents packed into rows of --seq tokens; the model gets each
document's causal mask and positions restarting per document (HF's ``position_ids``).
"""
from __future__ import annotations

import json
import sys

from transformers import LlamaConfig, LlamaForCausalLM

import resihp.trainer_hooks as resihp_hooks
from resihp.trainer_hooks.runtime.recovery import JobStopped
from resihp.trainer_hooks.usermodel.example_cli import checkpointer, leave, parse, plan_and_config


def main() -> None:
    args = parse(__doc__ or "")
    plan, config = plan_and_config(args)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    job = resihp_hooks.init(lambda: LlamaForCausalLM(cfg), plan, config=config,
                            checkpoint_dir=args.checkpoint_dir or None)  # resihp call 1
    ckpt = checkpointer(job, args)  # optional: layout-free checkpoints, by the model's own names
    out = open(args.losses, "a") if args.losses else None
    try:
        for it in job.iterations(args.steps):  # rewinds after a fail-stop; a spare waits here
            result = job.train_step(it)  # this rank's pipeline step; None if a peer died and the job recovered
            job.step(result)  # resihp call 2: report, apply re-plans at the step boundary
            if ckpt is not None and result is not None:
                ckpt.maybe_save(it, job.runtime, job.plan, every=args.checkpoint_every)
            if result is not None and result.loss is not None and result.replica == 0 and job.runtime is not None \
                    and job.runtime.groups.place.tp_index == 0:
                if out is not None:
                    out.write(json.dumps({"step": it, "loss": result.loss, "epoch": job.epoch}) + "\n")
                    out.flush()
                if it % args.log_every == 0 or it == args.steps - 1:
                    print(f"step {it:4d}  loss {result.loss:.4f}  epoch {job.epoch}  {job.plan.describe()}", flush=True)
    except JobStopped as exc:
        print(f"rank {job.rank}: the job stopped: {exc}", file=sys.stderr, flush=True)
        leave(True, 3)
    failed = job.resilience is not None and job.resilience.failures > 0
    if ckpt is not None:
        ckpt.close()
    job.close()
    leave(failed)


if __name__ == "__main__":
    main()
