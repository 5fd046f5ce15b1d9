"""A Hugging Face ``LlamaForCausalLM`` (tiny, random: nothing is downloaded), trained hybrid-parallel
and resilient: an ordinary loop plus resihp's two calls, and no layout spec — the model declares
its own TP and pipeline plans (``base_model_tp_plan`` / ``base_model_pp_plan``).

    resihp launch -n 8 --tp 2 --pp 2 --dp 2 -- python examples/llama/train.py --tp 2 --pp 2 --dp 2

GQA (4 heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU. Data: the Python standard library's
sources as byte-level documents packed into rows of --seq tokens; the model gets each
document's causal mask and positions restarting per document (HF's ``position_ids``).
"""
from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

import resihp.trainer_hooks as resihp_hooks
from resihp.trainer_hooks.runtime.recovery import JobStopped
from resihp.trainer_hooks.usermodel.example_cli import StepLog, finish, optimizer, parse, plan_and_config


def main() -> None:
    args = parse(__doc__ or "")
    plan, config = plan_and_config(args)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    job = resihp_hooks.init(lambda: LlamaForCausalLM(cfg), plan, config=config,
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
