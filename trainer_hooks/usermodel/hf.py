"""The layout spec of a Hugging Face decoder-only model, written from what the model declares.

``transformers`` models carry their own plans: ``config.base_model_tp_plan`` (per-block TP
styles, e.g. ``layers.*.self_attn.q_proj: colwise``) and ``base_model_pp_plan`` (the modules a
pipeline runs in order: ``embed_tokens``, ``layers``, ``norm``), plus the class's
``_pp_plan`` for the head and ``_tied_weights_keys`` for tied weights. ``hf_layout`` reads
them, so a ``transformers`` user writes no spec. The calls follow the decoder families that
share Llama's forward (Llama, Mistral, Qwen2, …): a rotary embedding module computes
``position_embeddings`` once per micro-batch, every decoder layer takes them with
``position_ids`` and an attention mask. Packed rows are supported: the mask is each
document's causal block and positions restart per document.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.usermodel.spec import CallContext, LayoutSpec, block_relative, known_style


def _plan(obj: Any, name: str) -> Mapping[str, Any]:
    value = getattr(obj, name, None)
    return value if isinstance(value, Mapping) else {}


def hf_layout(model: Any) -> LayoutSpec:
    """A LayoutSpec for a ``transformers`` causal LM (built or on meta); SpecError when the model
    does not declare the plans this needs."""
    config = getattr(model, "config", None)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    tp_plan = _plan(config, "base_model_tp_plan")
    pp_plan = _plan(config, "base_model_pp_plan")
    kind = type(model).__name__
    if config is None or not prefix or not pp_plan:
        raise SpecError(f"init: {kind} declares no base_model_pp_plan (or no base model); pass layout= a "
                        "LayoutSpec naming its blocks, pre and post modules")
    names = list(pp_plan)
    if len(names) < 2:
        raise SpecError(f"init: {kind}'s base_model_pp_plan {names} names no block list between its embedding and norm")
    base = getattr(model, prefix)
    blocks = next((n for n in names if type(getattr(base, n, None)).__name__ in ("ModuleList", "Sequential")), "")
    if not blocks:
        raise SpecError(f"init: none of {kind}'s base_model_pp_plan modules {names} is a block list")
    before = [f"{prefix}.{n}" for n in names[:names.index(blocks)]]
    after = [f"{prefix}.{n}" for n in names[names.index(blocks) + 1:]]
    head = [n for n in _plan(type(model), "_pp_plan") if n not in names] or ["lm_head"]  # the class's own plan: the head
    shared = [f"{prefix}.{n}" for n, m in base.named_children() if n not in names and not list(m.parameters())]
    rotary = next((s for s in shared if "rotary" in s), "")
    layer_plan: dict[str, object] = {}
    unsupported: list[str] = []
    block0 = dict(getattr(base, blocks)[0].named_modules())
    for key, style in tp_plan.items():
        path = block_relative(key, blocks)
        if path and path not in block0:
            continue  # declared for blocks of another kind (Qwen3-MoE's dense MLP layers), not this model's
        if path and known_style(style) is not None:
            layer_plan[path] = style
        elif path:
            unsupported.append(f"{path} = {style}")
    embed_scale, logit_scale, softcap = _scalars(config)
    window, layer_types = _sliding(config)
    eager = getattr(config, "_attn_implementation", None) in (None, "eager")
    tied: dict[str, str] = {}
    if getattr(config, "tie_word_embeddings", False):
        tied = {str(k): str(v) for k, v in _plan(model, "_tied_weights_keys").items()}
    embed_path = before[0]
    norm_paths = after

    def embed(stage: Any, ids: Any, ctx: CallContext) -> Any:
        hidden = stage.get_submodule(embed_path)(ids)
        return hidden if embed_scale == 1.0 else hidden * embed_scale

    def prepare(stage: Any, hidden: Any, ctx: CallContext) -> dict[str, Any]:
        if ctx.mask is not None and ctx.mask.dtype == torch.bool:
            # eager attention adds the mask to its scores (Gemma 2's, for its soft-capping): it
            # needs an additive one; SDPA takes the bool mask, a quarter of the memory at T x T
            form = (lambda m: additive(m, hidden)) if eager else (lambda m: m)
            if window is not None:
                t = ctx.mask.shape[-1]
                pos = torch.arange(t, device=ctx.mask.device)
                near = (pos[:, None] - pos[None, :]) < window  # key j within the window of query i
                ctx.masks["sliding_attention"] = form(ctx.mask & near)
            ctx.mask = form(ctx.mask)
        if not rotary:
            return {}
        return {"position_embeddings": stage.get_submodule(rotary)(hidden, ctx.positions)}

    def call_block(block: Any, hidden: Any, ctx: CallContext) -> Any:
        kind = layer_types[ctx.layer] if layer_types is not None else "sliding_attention" if window else ""
        mask = ctx.masks.get(kind, ctx.mask)
        out = block(hidden, attention_mask=mask, position_ids=ctx.positions, use_cache=False, **ctx.extras)
        return out[0] if isinstance(out, tuple) else out

    def run_head(stage: Any, hidden: Any, ctx: CallContext) -> Any:
        for path in norm_paths:
            hidden = stage.get_submodule(path)(hidden)
        for path in head:
            hidden = stage.get_submodule(path)(hidden)
        if logit_scale != 1.0:
            hidden = hidden * logit_scale
        if softcap is not None:
            hidden = torch.tanh(hidden / softcap) * softcap
        return hidden

    return LayoutSpec(
        blocks=f"{prefix}.{blocks}", pre=tuple(before), post=tuple(after + head), shared=tuple(shared),
        embed=embed, head=run_head, call_block=call_block, prepare=prepare, tp_plan=layer_plan, tied=tied,
        packed=True, max_positions=getattr(config, "max_position_embeddings", None), name=kind,
        tp_unsupported=tuple(unsupported),
    )


def additive(mask: Any, like: Any) -> Any:
    """A bool mask (True = may attend) as an additive one, 0 / the dtype's lowest: eager
    attention adds the mask to its scores, where a bool mask would add 0 / 1."""
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, torch.finfo(like.dtype).min)


def _sliding(config: Any) -> tuple[int | None, list[str] | None]:
    """(the sliding window, the per-layer attention kinds) as the families' forwards choose
    masks: with ``config.layer_types`` each layer by its kind (Gemma 2, Cohere 2, Qwen2 …);
    without, every layer slides when ``sliding_window`` is set (Mistral, Phi-3, Mixtral …);
    none when ``use_sliding_window`` is False. A key j is in query i's window when
    i − j < window, as ``transformers``' sliding-window mask has it."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not isinstance(window, int) or window <= 0:
        window = None
    kinds = getattr(config, "layer_types", None)
    layer_types = [str(k) for k in kinds] if isinstance(kinds, (list, tuple)) else None
    return window, layer_types


def _scalars(config: Any) -> tuple[float, float, float | None]:
    """What the decoder families' own forwards do around the modules their plans name, read
    from the config: (embedding multiplier — Granite, Falcon-H1; logit multiplier — Cohere's
    ``logit_scale``, Granite's 1 / ``logits_scaling``; final logit soft-cap — Gemma 2/3).
    A family doing something else is caught by ``check_hf_forward``."""
    def number(name: str) -> float | None:
        value = getattr(config, name, None)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    embed_scale = number("embedding_multiplier") or 1.0
    logit_scale = number("logit_scale") or 1.0
    divide = number("logits_scaling")
    if divide:
        logit_scale /= divide
    softcap = number("final_logit_softcapping")
    return embed_scale, logit_scale, softcap or None


def is_hf_model(model: Any) -> bool:
    """A ``transformers`` model (it declares a base-model pipeline plan)."""
    return bool(_plan(getattr(model, "config", None), "base_model_pp_plan")) and bool(
        getattr(model, "base_model_prefix", ""))
