"""A user's model as the runtime runs it: checked against its layout spec, cut into pipeline
stages, tensor-parallel sharded by its TP plan, and described as a ``ModelLayout`` (every
parameter by the name it has in the user's model) for the process groups, the reshard
planner and checkpoints.

How a stage is made: the model is built once per process (``template``: the user's own
initialisation, under the job's seed), a stage copies the modules it holds (its blocks; the
``pre`` modules on the first stage, the ``post`` ones on the last, the ``shared`` ones
everywhere) into a shell with the same attribute tree — so the spec's ``embed`` / ``head``
functions run on it unchanged — and replaces every linear layer the TP plan names with a
column- or row-parallel one holding its slice. Its parameters keep the user's names; a weight
tied between the two ends (an embedding shared with the LM head) is known by the name it has
first, on both stages that hold it.

Checks, before anything is allocated: the spec is read against the model built on the meta
device (``validate``): block list, module paths, TP plan, head counts, tied weights, and one
TP-sharded block run on meta tensors, so a forward that cannot take a split (it derives a head
size from its input width, say) is named at ``init``, not at the first step.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.model_source import spec_from_module
from resihp.trainer_hooks.runtime.layout import ModelLayout, TensorRule
from resihp.trainer_hooks.runtime.model import PackedMeta, shard_of
from resihp.trainer_hooks.runtime.tp_layers import (
    SINGLE,
    ColumnParallelLinear,
    FusedColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    pending_tp,
    sum_grad_over_tp,
)
from resihp.trainer_hooks.usermodel.hf import hf_layout, is_hf_model
from resihp.trainer_hooks.usermodel.hf_check import check_hf_forward
from resihp.trainer_hooks.usermodel.shard_probe import modules_seeing_a_shard
from resihp.trainer_hooks.usermodel.spec import COLWISE_FORMS, ROWWISE_FORMS, CallContext, LayoutSpec

ModelSource = nn.Module | Callable[[], nn.Module]


def _module(root: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError:
        top = ", ".join(n for n, _ in root.named_children()) or "none"
        raise SpecError(
            f"layout spec: {what} {path!r} is not a module of {type(root).__name__} (its top-level modules: {top})"
        ) from None


def _linear_paths(block: nn.Module) -> list[str]:
    return [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]


class UserModelRecipe:
    """A user's transformer, with its layout spec, as the runtime builds and reshards it.

    ``model``: the model itself (its weights are the job's initial weights: every rank must
    build the same, e.g. under one seed) or a factory that builds it (called under
    ``torch.manual_seed(seed)``, and on the meta device for the checks). ``spec``: the cost
    model's shape, read from ``model.config`` unless given."""

    def __init__(self, model: ModelSource, layout: LayoutSpec | None = None, *, spec: ModelSpec | None = None,
                 seed: int = 0) -> None:
        if layout is not None and not isinstance(layout, LayoutSpec):
            raise SpecError(f"init: layout must be a resihp LayoutSpec, got {type(layout).__name__}")
        self.seed = seed
        if isinstance(model, nn.Module):
            self._factory: Callable[[], nn.Module] | None = None
            probe: nn.Module = model
            self._template: nn.Module | None = model
        elif callable(model):
            self._factory = model
            with torch.device("meta"):
                probe = self._build_checked(model)
            self._template = None
        else:
            raise SpecError(f"init: model must be an nn.Module or a function that builds one, got {type(model).__name__}")
        if layout is None:
            if not is_hf_model(probe):
                raise SpecError(
                    f"init: resihp cannot tell how {type(probe).__name__} is laid out; pass layout=LayoutSpec(blocks=..., "
                    "pre=..., post=..., embed=..., head=..., tp_plan=...) (docs/your-model.md). Hugging Face models "
                    "need none: they declare base_model_tp_plan / base_model_pp_plan")
            layout = hf_layout(probe)
            check_hf_forward(probe)  # the reading against the model's own forward (a shrunk copy)
        self.layout_spec = layout
        self.spec = spec or spec_from_module(probe, layout.name)
        self._valid_tp: set[int] = set()
        self._partial: dict[int, tuple[str, ...]] = {}  # sharded_input_modules(tp), once worked out
        self._probe = probe
        self._read_layout(probe)

    @staticmethod
    def _build_checked(factory: Callable[[], nn.Module]) -> nn.Module:
        built = factory()
        if not isinstance(built, nn.Module):
            raise SpecError(f"init: the model factory returned {type(built).__name__}, not an nn.Module")
        return built

    # --- the spec against the model -------------------------------------------------------
    def _read_layout(self, probe: nn.Module) -> None:
        ls = self.layout_spec
        blocks = _module(probe, ls.blocks, "blocks")
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise SpecError(f"layout spec: blocks {ls.blocks!r} is a {type(blocks).__name__}, not a non-empty "
                            "ModuleList of the repeated blocks")
        self.num_layers = len(blocks)
        if self.num_layers != self.spec.num_layers:
            raise SpecError(f"layout spec: {ls.blocks!r} holds {self.num_layers} blocks but the model spec says "
                            f"{self.spec.num_layers} layers; pass spec= with the right num_layers")
        for what, paths in (("pre", ls.pre), ("post", ls.post), ("shared", ls.shared)):
            for path in paths:
                _module(probe, path, f"{what} module")
        block0 = blocks[0]
        linears = _linear_paths(block0)
        for path, form in ls.styles().items():
            if path not in dict(block0.named_modules()):
                raise SpecError(f"layout spec: tp_plan names {path!r}, which block 0 ({ls.blocks}.0, a "
                                f"{type(block0).__name__}) does not have; its linear layers: {', '.join(linears) or 'none'}")
            if form == "replicated_grad":
                if not list(block0.get_submodule(path).parameters()):
                    raise SpecError(f"layout spec: tp_plan[{path!r}] = replicated_with_grad_allreduce names a module "
                                    "with no parameters; leave it out of the plan")
                continue
            if not isinstance(block0.get_submodule(path), nn.Linear):
                raise SpecError(f"layout spec: tp_plan[{path!r}] is a {type(block0.get_submodule(path)).__name__}; "
                                "resihp splits nn.Linear layers only")
        for attr in ls.tp_divide:
            owner, _, name = attr.rpartition(".")
            holder = block0.get_submodule(owner) if owner else block0
            if not isinstance(getattr(holder, name, None), int):
                raise SpecError(f"layout spec: tp_divide names {attr!r}, which is no integer attribute of block 0")
        self._classify(probe)

    def _classify(self, probe: nn.Module) -> None:
        """Every parameter, by where it lives, with its TP split: the model's ModelLayout."""
        ls = self.layout_spec
        styles = ls.styles()
        by_id: dict[int, list[str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in probe.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            shapes[name] = tuple(p.shape)
        self.aliases: dict[str, str] = {}  # alias -> canonical (the first name the weight has)
        for names in by_id.values():
            for alias in names[1:]:
                self.aliases[alias] = names[0]
        for alias, target in ls.tied.items():
            if self.aliases.get(alias) != target and self.aliases.get(target) != alias:
                raise SpecError(f"layout spec: tied says {alias!r} is {target!r}, but the model holds them as two "
                                "different parameters; tie them in the model (as nanoGPT does) or drop the entry")

        def owner(name: str) -> str:
            for where, paths in (("pre", ls.pre), ("post", ls.post)):
                if any(name.startswith(p + ".") for p in paths):
                    return where
            return "block" if name.startswith(ls.blocks + ".") else ""

        first: list[TensorRule] = []
        last: list[TensorRule] = []
        ends: list[TensorRule] = []
        per_block: dict[int, list[TensorRule]] = {}
        self.fused_names: dict[str, int] = {}
        for names in by_id.values():
            canonical = names[0]
            places = {owner(n) for n in names}
            if "" in places:
                stray = next(n for n in names if owner(n) == "")
                raise SpecError(f"layout spec: parameter {stray!r} lies in no pre, block or post module; add its "
                                "module to pre (first stage) or post (last stage)")
            if places == {"pre", "post"}:
                ends.append(TensorRule(canonical, shapes[canonical]))
            elif len(places) > 1:
                raise SpecError(f"layout spec: parameter {canonical!r} is shared by {sorted(places)} modules; only a "
                                "weight tied between pre and post (embedding and LM head) can be")
            elif places == {"pre"}:
                first.append(TensorRule(canonical, shapes[canonical]))
            elif places == {"post"}:
                last.append(TensorRule(canonical, shapes[canonical]))
            else:
                rest = canonical[len(ls.blocks) + 1:]
                index, _, leaf = rest.partition(".")
                per_block.setdefault(int(index), []).append(self._rule(leaf, shapes[canonical], styles))
        rules = per_block.get(0, [])
        for i in range(self.num_layers):
            if per_block.get(i, []) != rules:
                raise SpecError(f"layout spec: block {i} of {ls.blocks!r} has other parameters than block 0; "
                                "resihp cuts a model whose blocks are all alike")
        self.model_layout = ModelLayout(tuple(first), ls.blocks + ".", tuple(rules), self.num_layers, tuple(last),
                                        tuple(ends))

    def _rule(self, leaf: str, shape: tuple[int, ...], styles: dict[str, str]) -> TensorRule:
        path, _, kind = leaf.rpartition(".")
        style = styles.get(path)
        if style is None:
            return TensorRule(leaf, shape)
        parts = int(self.layout_spec.fused.get(path, 1))
        if style in COLWISE_FORMS:
            if parts > 1:
                if shape[0] % parts:
                    raise SpecError(f"layout spec: {leaf} has {shape[0]} outputs, not {parts} equal parts")
                self.fused_names[leaf] = parts
                return TensorRule(leaf, (parts, shape[0] // parts, *shape[1:]), 1)
            return TensorRule(leaf, shape, 0)
        if style in ROWWISE_FORMS and kind == "weight":
            return TensorRule(leaf, shape, 1)
        return TensorRule(leaf, shape)  # a row-parallel bias (added once), a replicated module

    def check_plan(self, plan: Any) -> None:
        """``validate`` for every TP size ``plan`` uses (a re-plan's too: cached per size)."""
        self.validate(tp_sizes([plan]))

    def validate(self, tp_sizes: Iterable[int]) -> None:
        """Raise SpecError unless every TP size can split this model: heads, widths, the divided
        attributes, and one sharded block's forward on meta tensors (no memory)."""
        ls = self.layout_spec
        block0 = self._probe.get_submodule(ls.blocks)[0]  # pyright: ignore[reportIndexIssue]
        for tp in sorted(set(tp_sizes)):
            if tp == 1 or tp in self._valid_tp:
                continue
            if ls.tp_unsupported:
                raise SpecError(f"layout spec: {ls.name or 'the model'} declares TP styles resihp does not build "
                                f"({'; '.join(ls.tp_unsupported)}), so it cannot be split over TP size {tp}; run it "
                                "with TP 1 (pipeline and data parallel), or pass layout= a LayoutSpec whose tp_plan "
                                "uses colwise / rowwise")
            for heads, what in ((self.spec.num_heads, "attention heads"), (self.spec.kv_heads, "key/value heads")):
                if heads % tp:
                    raise SpecError(f"layout spec: TP size {tp} does not divide the model's {heads} {what}; "
                                    "use a TP size that divides both head counts")
            for path, style in ls.styles().items():
                if style == "replicated_grad":
                    continue
                lin = block0.get_submodule(path)
                n = lin.out_features if style in COLWISE_FORMS else lin.in_features
                parts = int(ls.fused.get(path, 1))
                if n % (parts * tp):
                    raise SpecError(f"layout spec: {path} has {n} {'outputs' if style in COLWISE_FORMS else 'inputs'}"
                                    f"{f' in {parts} parts' if parts > 1 else ''}, which TP size {tp} cannot split")
            for attr in ls.tp_divide:
                owner, _, name = attr.rpartition(".")
                value = getattr(block0.get_submodule(owner) if owner else block0, name)
                if value % tp:
                    raise SpecError(f"layout spec: tp_divide {attr} = {value} is not divisible by TP size {tp}")
            self._trial(tp)
            self._valid_tp.add(tp)

    def _meta_stage(self, tp: int, probing: bool = False) -> tuple[UserStage, torch.Tensor, PackedMeta]:
        """Block 0 with both ends, TP-sharded for ``tp`` on the meta device, and a row to run."""
        with torch.device("meta"):
            stage = self._stage_from(self._probe, (0, 1), True, True, pending_tp(0, tp), copy_weights=False,
                                     probing=probing)
            stage = stage.to("meta")  # a model the user built is real: its copied modules too
        tokens = torch.zeros(min(8, self.layout_spec.max_positions or 8), dtype=torch.long, device="meta")
        real = PackedMeta.from_seqlens([tokens.numel()])  # (built on the CPU: it reads lengths)
        return stage, tokens, PackedMeta(real.mask.to("meta"), real.positions.to("meta"))

    def sharded_input_modules(self, tp: int) -> tuple[str, ...]:
        """Block-relative paths of the replicated modules that see a TP shard under TP ``tp``
        (``shard_probe.modules_seeing_a_shard``), worked out once per size."""
        if tp not in self._partial:
            self._partial[tp] = modules_seeing_a_shard(
                lambda size: self._meta_stage(size, probing=True), self.layout_spec, tp)
        return self._partial[tp]

    def _trial(self, tp: int) -> None:
        stage, tokens, meta = self._meta_stage(tp)
        with torch.device("meta"):
            try:
                out = stage(tokens, meta)
            except Exception as exc:  # noqa: BLE001 - the user's forward, named with its error
                raise SpecError(
                    f"layout spec: one block of {self.layout_spec.blocks!r} does not run split over TP size {tp}: "
                    f"{type(exc).__name__}: {exc}. A block's forward must take its per-rank widths from the "
                    "attributes tp_divide names (or from its weights' shapes, as view(..., -1, head_dim) does), "
                    "not from the input's width") from None
        if tuple(out.shape) != (tokens.numel(), self.spec.vocab):
            raise SpecError(f"layout spec: the stage's output has shape {tuple(out.shape)}; head must return logits "
                            f"[1, T, {self.spec.vocab}]")

    # --- stages ---------------------------------------------------------------------------
    def layout(self) -> ModelLayout:
        return self.model_layout

    @property
    def packed(self) -> bool:
        return self.layout_spec.packed

    @property
    def max_positions(self) -> int | None:
        """The longest row the model takes: the spec's, else its config's position table."""
        if self.layout_spec.max_positions:
            return self.layout_spec.max_positions
        config = getattr(self._probe, "config", None)
        for name in ("block_size", "max_position_embeddings", "n_positions", "n_ctx"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def template(self) -> nn.Module:
        """The full model with the job's initial weights (built once per process)."""
        if self._template is None:
            assert self._factory is not None
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self._template = self._build_checked(self._factory)
        return self._template

    def build_stage(self, layer_range: tuple[int, int], first: bool, last: bool, tp: TPContext = SINGLE,
                    device: torch.device | None = None) -> UserStage:
        stage = self._stage_from(self.template(), layer_range, first, last, tp, copy_weights=True)
        return stage.to(device) if device is not None and device.type != "cpu" else stage

    def _stage_from(self, root: nn.Module, layer_range: tuple[int, int], first: bool, last: bool, tp: TPContext,
                    copy_weights: bool, probing: bool = False) -> UserStage:
        ls = self.layout_spec
        start, end = layer_range
        if not 0 <= start < end <= self.num_layers:
            raise SpecError(f"model: layer range [{start}, {end}) is outside 0..{self.num_layers}")
        keep = [f"{ls.blocks}.{i}" for i in range(start, end)] + list(ls.shared)
        keep += list(ls.pre) if first else []
        keep += list(ls.post) if last else []
        # (probing: sharded_input_modules itself, which compares shapes only)
        partial = self.sharded_input_modules(tp.size) if tp.size > 1 and not probing else ()
        shell = _prune(root, "", set(keep), {})
        stage = UserStage(self, shell, layer_range, first, last, tp)
        for i in range(start, end):
            _shard_block(stage.get_submodule(f"{ls.blocks}.{i}"), ls, tp, copy_weights, partial)
        return stage

    def full_tensor(self, name: str) -> torch.Tensor:
        """The initial, unsharded value of a layout tensor, in its layout shape."""
        p = self.template().get_parameter(name)
        leaf = name[len(self.layout_spec.blocks) + 1:].partition(".")[2] if name.startswith(
            self.layout_spec.blocks + ".") else ""
        parts = self.fused_names.get(leaf, 1)
        return p.detach().reshape(parts, -1, *p.shape[1:]) if parts > 1 else p.detach()


class _Absent(nn.Module):
    """Stands for a module another stage holds."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module is held by another pipeline stage")


def _prune(module: nn.Module, prefix: str, keep: set[str], memo: dict[int, Any]) -> nn.Module:
    """A copy of ``module`` holding only the sub-modules under ``keep`` (one deep-copy memo for
    all of them, so a weight tied inside the stage stays one parameter)."""
    if prefix in keep:
        return copy.deepcopy(module, memo)
    clone = copy.copy(module)
    clone._modules = {}  # pyright: ignore[reportAttributeAccessIssue]  # a fresh child table for the copy
    clone._parameters = {}  # pyright: ignore[reportAttributeAccessIssue]
    clone._buffers = {k: (copy.deepcopy(v, memo) if v is not None else None)  # pyright: ignore[reportAttributeAccessIssue]
                      for k, v in module._buffers.items()}
    for name, child in module._modules.items():
        path = f"{prefix}.{name}" if prefix else name
        if child is None:
            clone._modules[name] = None
        elif path in keep or any(k.startswith(path + ".") for k in keep):
            clone._modules[name] = _prune(child, path, keep, memo)
        else:
            clone._modules[name] = _Absent()
    return clone


@torch.no_grad()
def _shard_block(block: nn.Module, ls: LayoutSpec, tp: TPContext, copy_weights: bool,
                 partial: Sequence[str] = ()) -> None:
    """Replace the block's planned linear layers by parallel ones holding TP rank ``tp.index``'s
    slice (of the weights they replace, when ``copy_weights``), sum the gradients of the
    replicated modules that see a shard (``partial``: UserModelRecipe.sharded_input_modules),
    and divide its per-rank attributes."""
    styles = ls.styles()
    for path in partial:
        if styles.get(path) is None:  # a declared replicated_with_grad_allreduce is summed below
            # its own parameters only: a sub-module that sees a shard is in ``partial`` itself
            sum_grad_over_tp(block.get_submodule(path), tp, recurse=False)
    for path, style in styles.items():
        owner_path, _, attr = path.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        lin = getattr(owner, attr)
        if style == "replicated_grad":
            sum_grad_over_tp(lin, tp)
            continue
        has_bias = lin.bias is not None
        parts = int(ls.fused.get(path, 1))
        new: nn.Module
        if style == "colwise" and parts > 1:
            new = FusedColumnParallelLinear(lin.in_features, lin.out_features, parts, tp, has_bias)
            if copy_weights:
                new.weight.copy_(shard_of(lin.weight.reshape(parts, -1, lin.in_features), 1, tp))
                if has_bias:
                    new.bias.copy_(shard_of(lin.bias.reshape(parts, -1), 1, tp))  # pyright: ignore[reportOptionalMemberAccess]
        elif style in COLWISE_FORMS:
            new = ColumnParallelLinear(lin.in_features, lin.out_features, tp, has_bias, style == "colwise_gather")
            if copy_weights:
                new.weight.copy_(shard_of(lin.weight, 0, tp))
                if has_bias:
                    new.bias.copy_(shard_of(lin.bias, 0, tp))  # pyright: ignore[reportOptionalMemberAccess]
        else:
            new = RowParallelLinear(lin.in_features, lin.out_features, tp, has_bias, style == "rowwise_split")
            if copy_weights:
                new.weight.copy_(shard_of(lin.weight, 1, tp))
                if has_bias:
                    new.bias.copy_(lin.bias)  # pyright: ignore[reportOptionalMemberAccess]
        setattr(owner, attr, new.to(lin.weight.device) if not lin.weight.is_meta else new)
    for path in ls.tp_divide:
        owner_path, _, attr = path.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        setattr(owner, attr, getattr(owner, attr) // tp.size)


class UserStage(nn.Module):
    """Blocks ``[start, end)`` of a user's model, with its pre modules on the first stage and its
    post modules on the last, in a shell with the model's own attribute tree. Called as the
    runtime calls a stage: ``stage(tokens[T] | hidden[T, H], meta) -> hidden[T, H] | logits[T, V]``."""

    def __init__(self, recipe: UserModelRecipe, shell: nn.Module, layer_range: tuple[int, int], first: bool,
                 last: bool, tp: TPContext) -> None:
        super().__init__()
        taken = {"spec", "layer_range", "first", "last", "tp", "recipe", "layout_spec"}
        for name, child in shell.named_children():
            if name in taken:
                raise SpecError(f"layout spec: the model has a top-level module named {name!r}, a name resihp's "
                                "stage uses; wrap the model in a module of your own")
            self.add_module(name, child)
        self.spec = recipe.spec
        self.layout_spec = recipe.layout_spec
        self.layer_range = layer_range
        self.first = first
        self.last = last
        self.tp = tp
        self._recipe = [recipe]  # a list: not a sub-module, not in the state
        self._blocks = [self.get_submodule(f"{recipe.layout_spec.blocks}.{i}") for i in range(*layer_range)]

    def logical_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters by layout name (a tied alias under the name its weight has first)."""
        aliases = self._recipe[0].aliases
        out: dict[str, nn.Parameter] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            out.setdefault(aliases.get(name, name), p)
        return out

    @torch.no_grad()
    def init_from_seed(self, seed: int) -> None:
        """Every parameter from the model's initial weights (``seed`` is the recipe's: the factory
        ran under it; a module the user built brought its own)."""
        recipe = self._recipe[0]
        layout = {s.name: s for s in recipe.model_layout.tensor_specs()}
        for name, p in self.logical_parameters().items():
            spec = layout[name]
            p.copy_(shard_of(recipe.full_tensor(name), spec.tp_dim, self.tp))

    def forward(self, x: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        ls = self.layout_spec
        t = x.shape[0]
        if ls.packed:
            ctx = CallContext(meta.positions[None], meta.mask[None, None], ())
        else:  # each row is one sequence to this model
            ctx = CallContext(torch.arange(t, device=x.device)[None], None, (t,))
        h = ls.embed(self, x[None], ctx) if self.first else x[None]
        if ls.prepare is not None:
            ctx.extras.update(ls.prepare(self, h, ctx))
        call = ls.call_block
        for layer, block in zip(range(*self.layer_range), self._blocks, strict=True):
            ctx.layer = layer
            h = call(block, h, ctx) if call is not None else block(h)
        if self.last:
            h = ls.head(self, h, ctx)
        return h[0]


def tp_sizes(plans: Sequence[Any]) -> set[int]:
    """Every TP size the plans use."""
    return {len(g) for plan in plans for rep in plan.replicas for g in rep.stages}


def recipe_for(model: Any, layout: LayoutSpec | None, plan: Any, config: Any) -> UserModelRecipe | None:
    """``init``'s recipe for a user's own model under ``plan`` (None: ``model`` names a shape, and
    the runtime trains its own GPT), checked against the plan and the config before any stage is
    allocated."""
    if not isinstance(model, nn.Module) and not (callable(model) and not isinstance(model, (str, os.PathLike))):
        if layout is not None:
            raise SpecError("init: layout= describes a model of yours; pass that model (or a function that builds "
                            "it) as model=")
        return None
    recipe = UserModelRecipe(cast(ModelSource, model), layout, seed=config.seed)
    recipe.validate(tp_sizes([plan]))
    limit = recipe.max_positions
    if limit is not None and config.budget > limit:
        raise SpecError(f"init: a micro-batch holds {config.budget} tokens but {recipe.spec.name} takes rows of at most "
                        f"{limit} (its position table); lower TrainConfig.max_seq_len / tokens_per_microbatch")
    return recipe
