"""The two user models the your-own-model tests run: the nanoGPT example (examples/nanogpt) and a
tiny random Hugging Face LlamaForCausalLM (GQA, RoPE, RMSNorm, SwiGLU), each as a recipe."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "nanogpt"))

from layout import NANOGPT_LAYOUT  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe  # noqa: E402

LAYERS = 4
SEQ = 32


def nanogpt_factory(n_head: int = 4) -> Callable[[], Any]:
    cfg = GPTConfig(block_size=SEQ, vocab_size=256, n_layer=LAYERS, n_head=n_head, n_embd=32, dropout=0.0, bias=True)
    return lambda: GPT(cfg)


def llama_factory(heads: int = 8, kv_heads: int = 4) -> Callable[[], Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ)
    return lambda: LlamaForCausalLM(cfg)


# other Hugging Face decoder families, each with something Llama does not have: Qwen3's per-head
# q/k norms (replicated_with_grad_allreduce) and head_dim x heads != hidden; Phi-3's fused
# qkv / gate_up (colwise_gather_output, rowwise_split_input); Gemma 2's scaled embedding,
# eager attention with soft-capping (an additive mask) and final logit soft-cap; Cohere's
# logit scale; Apertus's learnable activation (xIELU) between the column- and the row-parallel
# MLP layers, which sees a TP shard and whose plan does not say so
HF_FAMILIES = ("qwen3", "phi3", "gemma2", "cohere", "apertus")


def hf_factory(family: str) -> Callable[[], Any]:
    import transformers

    cls = {"qwen3": "Qwen3", "phi3": "Phi3", "gemma2": "Gemma2", "cohere": "Cohere", "apertus": "Apertus"}[family]
    extra: dict[str, Any] = {"head_dim": 16} if family == "qwen3" else {}
    if family == "gemma2":
        extra["sliding_window"] = 8  # its sliding layers (every other one) then see less than a document
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, pad_token_id=None, bos_token_id=1, eos_token_id=2, **extra)
    model_cls = getattr(transformers, f"{cls}ForCausalLM")
    return lambda: model_cls(cfg)


def recipe(name: str, seed: int = 0) -> UserModelRecipe:
    if name == "nanogpt":
        return UserModelRecipe(nanogpt_factory(), NANOGPT_LAYOUT, seed=seed)
    if name in HF_FAMILIES:
        return UserModelRecipe(hf_factory(name), seed=seed)
    return UserModelRecipe(llama_factory(), seed=seed)


MODELS = ("nanogpt", "llama")
