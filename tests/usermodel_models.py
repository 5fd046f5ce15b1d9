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


def recipe(name: str, seed: int = 0) -> UserModelRecipe:
    if name == "nanogpt":
        return UserModelRecipe(nanogpt_factory(), NANOGPT_LAYOUT, seed=seed)
    return UserModelRecipe(llama_factory(), seed=seed)


MODELS = ("nanogpt", "llama")
