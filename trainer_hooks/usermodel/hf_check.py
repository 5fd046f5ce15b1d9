"""Does resihp's reading of a Hugging Face model compute what the model's own forward computes?

``hf_layout`` rebuilds a causal LM's forward from what the model declares: its pipeline plan
(embedding, blocks, norm), its head, and the few config scalars the decoder families apply
around them (``hf._scalars``). A family whose ``forward`` does something else between or
around those modules — a scale, a cap, an extra module — would train a different function,
silently. So at ``init`` the reading is run once against the model's own forward, on a copy
of the same class with the same config shrunk to two blocks and tiny widths (the same code
paths and scalars, milliseconds of CPU, whatever the real model's size), with two packed
documents against each document run alone. A mismatch is a SpecError naming the difference;
a config that cannot be shrunk (a family with widths this does not know) is logged and
skipped, never a crash.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from resihp.coordinator.model.spec import SpecError

log = logging.getLogger(__name__)

HEAD_DIM = 8  # the shrunk copy's attention head width
WINDOW = 4  # the shrunk copy's sliding window, where the family has one (rows of 16 tokens)
TOLERANCE = 1e-3  # of the logits' largest magnitude: float32 reduction-order noise is ~1e-6


def shrunk_config(config: Any) -> Any:
    """The config with two blocks, head width ``HEAD_DIM``, MLP widths of 16, a sliding window
    (where it has one) of ``WINDOW`` and a vocabulary of at most 128 (head counts, scalars,
    attention kind and RoPE settings kept)."""
    cfg = copy.deepcopy(config)
    layers = min(2, int(cfg.num_hidden_layers))
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    heads = int(cfg.num_attention_heads)
    cfg.hidden_size = heads * HEAD_DIM
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = HEAD_DIM
    for name, width in (("intermediate_size", 16), ("moe_intermediate_size", 8),
                        ("shared_expert_intermediate_size", 8)):
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, width)
    if isinstance(getattr(cfg, "sliding_window", None), int):
        cfg.sliding_window = WINDOW  # shorter than the check's rows: the window's mask is exercised
    vocab = min(int(cfg.vocab_size), 128)
    cfg.vocab_size = vocab
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value >= vocab:
            setattr(cfg, name, None)
    return cfg


def check_hf_forward(model: Any) -> None:
    """Raise SpecError when ``hf_layout``'s stage of (a shrunk copy of) ``model`` computes other
    logits than ``model``'s own forward."""
    from resihp.trainer_hooks.runtime.model import PackedMeta
    from resihp.trainer_hooks.usermodel.hf import hf_layout
    from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe

    kind = type(model).__name__
    try:
        cfg = shrunk_config(model.config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            small = type(model)(cfg).float().eval()
        positions = getattr(cfg, "max_position_embeddings", None) or 16
        length = max(4, min(16, int(positions)))
        seqlens = [length - length // 3, length // 3]
        tokens = torch.randint(0, int(cfg.vocab_size), (length,), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            reference, start = [], 0
            for n in seqlens:
                reference.append(small(input_ids=tokens[None, start:start + n]).logits[0].float())
                start += n
            want = torch.cat(reference)
            recipe = UserModelRecipe(small, hf_layout(small))
            stage = recipe.build_stage((0, recipe.num_layers), True, True).eval()
            got = stage(tokens, PackedMeta.from_seqlens(seqlens)).float()
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - a family this check cannot shrink: the training itself still runs
        log.warning("could not check resihp's reading of %s against its own forward (%s: %s); the model is used "
                    "as its plans declare it", kind, type(exc).__name__, exc)
        return
    scale = max(float(want.abs().max()), 1.0)
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not diff <= TOLERANCE * scale:
        raise SpecError(
            f"init: {kind}'s own forward computes other logits than resihp's reading of its declared plans (largest "
            f"difference {diff:.3g} against logits up to {scale:.3g}, on a two-block copy): its forward does something "
            "around its embedding, blocks, norm or head that base_model_pp_plan does not say (a scale, a soft-cap, an "
            "extra module). Pass layout= a LayoutSpec whose embed / head functions do what its forward does "
            "(docs/your-model.md)")
