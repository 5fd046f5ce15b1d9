"""The layout spec: what resihp needs to know to cut, shard and run a user's transformer.

A user describes the model they already have, in a few lines and without changing its code:

    NANOGPT = LayoutSpec(
        blocks="transformer.h",                                     # the repeated blocks
        pre=("transformer.wte", "transformer.wpe", "transformer.drop"),   # first stage only
        post=("transformer.ln_f", "lm_head"),                       # last stage only
        embed=lambda m, idx, ctx: m.transformer.drop(m.transformer.wte(idx) + m.transformer.wpe(ctx.positions)),
        head=lambda m, h, ctx: m.lm_head(m.transformer.ln_f(h)),
        tp_plan={"attn.c_attn": "colwise", "attn.c_proj": "rowwise",
                 "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
        fused={"attn.c_attn": 3},                                   # q, k, v side by side
        tp_divide=("attn.n_head", "attn.n_embd"),                   # per-rank head count / width
        tied={"lm_head.weight": "transformer.wte.weight"},
    )

The TP plan speaks ``torch.distributed.tensor.parallel``'s vocabulary: ``"colwise"`` /
``ColwiseParallel()`` splits a linear layer's outputs, ``"rowwise"`` / ``RowwiseParallel()`` its
inputs (and all-reduces the partial sums). Hugging Face models declare theirs
(``config.base_model_tp_plan``), so ``hf_layout`` (trainer_hooks/usermodel/hf.py) writes the spec.

This module is pure (no torch import): the callables are typed loosely and only called by the
stage runner (trainer_hooks/usermodel/stage.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resihp.coordinator.model.spec import SpecError

# a user's hook: (the stage module, a tensor, the micro-batch's CallContext) -> a tensor
StageFn = Callable[[Any, Any, Any], Any]

# torch / Hugging Face names -> the form resihp builds (trainer_hooks/runtime/tp_layers.py)
_STYLES = {
    **dict.fromkeys(("colwise", "colwiseparallel", "local_colwise"), "colwise"),  # outputs split
    **dict.fromkeys(("rowwise", "rowwiseparallel", "local_rowwise"), "rowwise"),  # inputs split, sums reduced
    # outputs split, then gathered whole (HF's colwise_rep is the same: output replicated)
    **dict.fromkeys(("colwise_gather_output", "colwise_rep"), "colwise_gather"),
    # a whole input, this rank's slice of it used (HF's rowwise_rep: input replicated)
    **dict.fromkeys(("rowwise_split_input", "rowwise_rep"), "rowwise_split"),
    "replicated_with_grad_allreduce": "replicated_grad",  # replicated; gradients summed over TP
}
COLWISE_FORMS = ("colwise", "colwise_gather")  # weight rows split (dimension 0)
ROWWISE_FORMS = ("rowwise", "rowwise_split")  # weight columns split (dimension 1)


def _placement(style: object, attr: str) -> str:
    """'replicate', 'shard-last' or 'other': a torch style object's single input or output
    layout (read by class name and ``dim``: this module does not import torch)."""
    layouts = getattr(style, attr, None)
    one = layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts
    kind = type(one).__name__
    if kind == "Replicate":
        return "replicate"
    return "shard-last" if kind == "Shard" and getattr(one, "dim", None) == -1 else "other"


def known_style(value: object) -> str | None:
    """The form resihp builds for a plan entry (a string of torch / Hugging Face names, or a
    ``torch.distributed.tensor.parallel`` style object, read by its class and its layouts:
    ``ColwiseParallel(output_layouts=Replicate())`` gathers its output, ``RowwiseParallel(
    input_layouts=Replicate())`` splits a whole input); None if it builds none."""
    if isinstance(value, str):
        return _STYLES.get(value.strip().lower())
    name = type(value).__name__
    if name == "ColwiseParallel" and _placement(value, "input_layouts") == "replicate":
        return {"shard-last": "colwise", "replicate": "colwise_gather"}.get(_placement(value, "output_layouts"))
    if name == "RowwiseParallel" and _placement(value, "output_layouts") == "replicate":
        return {"shard-last": "rowwise", "replicate": "rowwise_split"}.get(_placement(value, "input_layouts"))
    return _STYLES.get(name.lower()) if name not in ("ColwiseParallel", "RowwiseParallel") else None


def tp_style(value: object, where: str) -> str:
    """The form resihp builds for a plan entry (``known_style``), or a SpecError naming the entry."""
    form = known_style(value)
    if form is None:
        text = value if isinstance(value, str) else type(value).__name__
        raise SpecError(
            f"layout spec: tp_plan[{where!r}] = {text!r} is not a style resihp shards; use 'colwise' "
            "(ColwiseParallel: outputs split), 'rowwise' (RowwiseParallel: inputs split), 'colwise_gather_output', "
            "'rowwise_split_input' or 'replicated_with_grad_allreduce', or leave the module out of the plan to "
            "replicate it"
        )
    return form


@dataclass(frozen=True)
class LayoutSpec:
    """How a user's model is laid out: module paths are dotted names in ``model.named_modules()``;
    ``tp_plan``, ``fused`` and ``tp_divide`` name paths *inside one block*.

    ``embed(stage, tokens[1, T], ctx) -> hidden[1, T, H]`` runs the ``pre`` modules;
    ``head(stage, hidden, ctx) -> logits[1, T, V]`` runs the ``post`` modules;
    ``call_block(block, hidden, ctx) -> hidden`` runs one block (default ``block(hidden)``);
    ``prepare(stage, hidden, ctx) -> dict`` computes what every block of a micro-batch shares
    (rotary tables) into ``ctx.extras``, on every stage, from the ``shared`` modules.
    ``packed``: the model takes document masks (``ctx.mask``, ``ctx.positions`` restarting per
    document); without them each packed row is one sequence to it, and is reported as one.
    """

    blocks: str
    embed: StageFn
    head: StageFn
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    call_block: StageFn | None = None
    prepare: StageFn | None = None
    shared: tuple[str, ...] = ()
    tp_plan: Mapping[str, object] = field(default_factory=dict)
    fused: Mapping[str, int] = field(default_factory=dict)
    tp_divide: tuple[str, ...] = ()
    tied: Mapping[str, str] = field(default_factory=dict)  # alias parameter -> the parameter it is
    packed: bool = False
    max_positions: int | None = None  # the longest row the model takes (a position table's size)
    name: str = ""
    # plan entries a model declares in a style resihp does not build ("path = style"): nothing
    # is split at TP 1, so they matter only to a plan with TP > 1, which ``validate`` refuses
    tp_unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, str) or not self.blocks.strip():
            raise SpecError("layout spec: blocks must name the block list, e.g. 'transformer.h' or 'model.layers'")
        for what in ("pre", "post", "shared", "tp_divide"):
            value = getattr(self, what)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise SpecError(f"layout spec: {what} must be a tuple of dotted module paths, got {value!r}")
        for fn in ("embed", "head"):
            if not callable(getattr(self, fn)):
                raise SpecError(f"layout spec: {fn} must be a function (stage, tensor, ctx) -> tensor")
        styles = {k: tp_style(v, k) for k, v in self.tp_plan.items()}
        for path, parts in self.fused.items():
            if styles.get(path) != "colwise":
                raise SpecError(f"layout spec: fused[{path!r}] names a module the TP plan does not split colwise; "
                                "only a column-parallel layer has outputs side by side")
            if not isinstance(parts, int) or parts < 1:
                raise SpecError(f"layout spec: fused[{path!r}] must be a positive number of parts, got {parts!r}")
        for alias, target in self.tied.items():
            if alias == target:
                raise SpecError(f"layout spec: tied[{alias!r}] names itself")

    def styles(self) -> dict[str, str]:
        """Block-relative module path -> the form resihp builds ('colwise', 'rowwise',
        'colwise_gather', 'rowwise_split', 'replicated_grad')."""
        return {k: tp_style(v, k) for k, v in self.tp_plan.items()}


@dataclass
class CallContext:
    """What the hooks of a spec get for one micro-batch: ``positions`` [1, T] (0..T-1, or
    restarting per document for a ``packed`` model), ``mask`` ([1, 1, T, T] bool, True = may
    attend; None for a model without document masking), the documents' lengths, what
    ``prepare`` computed (``extras``: passed to every block), the index in the whole model of
    the block being called (``layer``), and masks a spec keeps for some of its blocks
    (``masks``, e.g. a sliding window's: not passed on)."""

    positions: Any
    mask: Any
    seqlens: tuple[int, ...]
    extras: dict[str, Any] = field(default_factory=dict)
    layer: int = -1
    masks: dict[str, Any] = field(default_factory=dict)


def block_relative(path: str, blocks: str) -> str:
    """``layers.*.self_attn.q_proj`` (a Hugging Face plan key, relative to the base model) ->
    ``self_attn.q_proj`` when ``blocks`` ends in ``layers``; empty when the key is outside."""
    tail = blocks.rsplit(".", 1)[-1]
    prefix = f"{tail}.*."
    return path[len(prefix):] if path.startswith(prefix) else ""
