"""A Hugging Face ``LlamaForCausalLM`` (tiny, random: nothing is downloaded), trained hybrid-parallel
and resilient: an ordinary loop plus resihp's two calls, and no layout spec — the model declares
its own TP and pipeline plans (``base_model_tp_plan`` / ``base_model_pp_plan``).

    resihp launch -n 8 --tp 2 --pp 2 --dp 2 -- python examples/llama/train.py --tp 2 --pp 2 --dp 2

GQA (4 heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU. Data: the Python standard library's
sources as byte-level documents packed into rows of --seq tokens; the model gets each
document's causal mask and positions restarting per document (HF's ``position_ids``).

The same loop trains other Hugging Face decoder families of the same size, unchanged:
``--family qwen3`` (or mistral, phi3, gemma2, cohere, olmo2, granite) picks ``Qwen3ForCausalLM``
and so on.
"""
from __future__ import annotations

from typing import Any

import transformers

import resihp.trainer_hooks as resihp_hooks
from resihp.trainer_hooks.runtime.recovery import JobStopped
from resihp.trainer_hooks.usermodel.example_cli import StepLog, finish, optimizer, parse, plan_and_config

FAMILIES = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3", "gemma2": "Gemma2",
            "cohere": "Cohere", "olmo2": "Olmo2", "granite": "Granite"}


def main() -> None:
    args = parse(__doc__ or "", own=lambda p: p.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                                                             help="the Hugging Face decoder family"))
    plan, config = plan_and_config(args)
    family = FAMILIES[args.family]
    extra: dict[str, Any] = {"head_dim": 16} if family == "Qwen3" else {}  # Qwen3: heads x head_dim != hidden
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.seq, pad_token_id=None, bos_token_id=1, eos_token_id=2,
        **extra)
    model_class = getattr(transformers, f"{family}ForCausalLM")
    job = resihp_hooks.init(lambda: model_class(cfg), plan, config=config,
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
