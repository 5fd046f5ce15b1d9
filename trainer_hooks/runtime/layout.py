"""Where every tensor of the reference GPT lives under a Plan.

The contract (docs/reshard.md, and this module's table): logical, unsharded parameter
names and shapes; which pipeline position holds each; which dimension tensor parallelism
splits. The runtime names its ``nn.Parameter``s exactly so, and the reshard planner reads
the same table, so both agree on what "slice [a, b) of ``layers.3.mlp.fc1.weight``" means.

Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError

Index = tuple[slice, ...]
WHERE = ("layer", "first", "last", "ends")

# (suffix, shape key, tp_dim, unit key) for the tensors of one transformer layer; the unit
# keeps whole heads together: q, k, v rows of a head (3·head_dim) or its proj columns (head_dim)
_LAYER_TENSORS: tuple[tuple[str, str, int | None, str], ...] = (
    ("ln1.weight", "h", None, "1"),
    ("ln1.bias", "h", None, "1"),
    ("attn.qkv.weight", "3h,h", 0, "3d"),
    ("attn.qkv.bias", "3h", 0, "3d"),
    ("attn.proj.weight", "h,h", 1, "d"),
    ("attn.proj.bias", "h", None, "1"),
    ("ln2.weight", "h", None, "1"),
    ("ln2.bias", "h", None, "1"),
    ("mlp.fc1.weight", "f,h", 0, "1"),
    ("mlp.fc1.bias", "f", 0, "1"),
    ("mlp.fc2.weight", "h,f", 1, "1"),
    ("mlp.fc2.bias", "h", None, "1"),
)


@dataclass(frozen=True)
class TensorSpec:
    """One logical (global, unsharded) tensor of the model."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # global layer index; None for the first/last-stage tensors
    # "layer" | "first" | "last" | "ends": a weight tied between the first and the last stage (an
    # embedding shared with the LM head): both hold a copy, and their gradients are summed
    where: str
    tp_dim: int | None  # dimension TP splits, None if replicated within a TP group
    tp_unit: int = 1  # rows along tp_dim that must stay together (one attention head's q,k,v)

    def __post_init__(self) -> None:
        if self.where not in WHERE:
            raise SpecError(f"tensor {self.name!r}: where must be one of {list(WHERE)}, got {self.where!r}")
        if (self.where == "layer") != (self.layer is not None):
            raise SpecError(f"tensor {self.name!r}: a layer index is given exactly when where == 'layer'")
        if any(d <= 0 for d in self.shape):
            raise SpecError(f"tensor {self.name!r}: shape {self.shape} has a non-positive dimension")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise SpecError(f"tensor {self.name!r}: tp_dim {self.tp_dim} out of range for shape {self.shape}")
        if self.tp_unit < 1 or (self.tp_dim is not None and self.shape[self.tp_dim] % self.tp_unit):
            raise SpecError(f"tensor {self.name!r}: tp_unit {self.tp_unit} does not divide the split dimension")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorRule:
    """One parameter of a model's layout: its name (relative to a block for layer tensors), its
    global shape and the dimension TP splits (None = replicated in a TP group)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_unit: int = 1


@dataclass(frozen=True)
class ModelLayout:
    """Every tensor of a model, by where a pipeline holds it: what the first stage runs before the
    blocks, the tensors of one block (every block alike, under ``layer_prefix + i + "."``),
    what the last stage runs after them, and weights tied between the two ends.

    The runtime's GPT has one (``gpt_layout``); a user's model gets one from its layout spec
    (trainer_hooks/usermodel). Hashable: process-group tables are cached per layout."""

    first: tuple[TensorRule, ...]
    layer_prefix: str
    layer: tuple[TensorRule, ...]
    num_layers: int
    last: tuple[TensorRule, ...]
    ends: tuple[TensorRule, ...] = ()

    def tensor_specs(self) -> list[TensorSpec]:
        """Every tensor, in model order (first stage, blocks, last stage, tied)."""
        specs = [TensorSpec(r.name, r.shape, None, "first", r.tp_dim, r.tp_unit) for r in self.first]
        for i in range(self.num_layers):
            specs += [TensorSpec(f"{self.layer_prefix}{i}.{r.name}", r.shape, i, "layer", r.tp_dim, r.tp_unit)
                      for r in self.layer]
        specs += [TensorSpec(r.name, r.shape, None, "last", r.tp_dim, r.tp_unit) for r in self.last]
        specs += [TensorSpec(r.name, r.shape, None, "ends", r.tp_dim, r.tp_unit) for r in self.ends]
        return specs

    def names(self, first: bool, last: bool, layer_range: tuple[int, int]) -> list[str]:
        """The tensors a stage holds: the first/last stage's own, its blocks', the tied ones."""
        out = [r.name for r in self.first] if first else []
        out += [f"{self.layer_prefix}{i}.{r.name}" for i in range(*layer_range) for r in self.layer]
        if last:
            out += [r.name for r in self.last]
        if first or last:
            out += [r.name for r in self.ends]
        return out


def gpt_layout(model: ModelSpec, max_seq_len: int = 1) -> ModelLayout:
    """The reference GPT's layout (``max_seq_len``: the position table's rows)."""
    if model.gated_mlp or model.kv_heads != model.num_heads:
        raise SpecError(
            f"model {model.name!r}: the reference GPT has a plain GELU MLP and full multi-head attention; "
            "use a spec with gated_mlp=False and num_kv_heads=0 (e.g. the 'gpt-tiny' preset)"
        )
    if not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise SpecError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    h, f, v = model.hidden, model.ffn_hidden, model.vocab
    dims = {"h": (h,), "3h": (3 * h,), "f": (f,), "3h,h": (3 * h, h), "h,h": (h, h), "f,h": (f, h), "h,f": (h, f)}
    units = {"1": 1, "d": model.head_dim, "3d": 3 * model.head_dim}
    return ModelLayout(
        first=(TensorRule("embed.weight", (v, h)), TensorRule("pos_embed.weight", (max_seq_len, h))),
        layer_prefix="layers.",
        layer=tuple(TensorRule(suffix, dims[key], tp_dim, units[unit]) for suffix, key, tp_dim, unit in _LAYER_TENSORS),
        num_layers=model.num_layers,
        last=(TensorRule("final_ln.weight", (h,)), TensorRule("final_ln.bias", (h,)),
              TensorRule("lm_head.weight", (v, h))),
    )


def gpt_tensor_specs(model: ModelSpec, max_seq_len: int) -> list[TensorSpec]:
    """Every tensor of the reference GPT, in model order (embeddings, layers, head)."""
    return gpt_layout(model, max_seq_len).tensor_specs()


def split_bounds(spec: TensorSpec, tp_index: int, tp_size: int) -> tuple[int, int]:
    """[start, end) along ``spec.tp_dim`` held by TP rank ``tp_index`` (whole dim if not split)."""
    if tp_size < 1 or not 0 <= tp_index < tp_size:
        raise SpecError(f"tensor {spec.name!r}: TP index {tp_index} is not within a group of size {tp_size}")
    if spec.tp_dim is None:
        return 0, spec.shape[0]
    n = spec.shape[spec.tp_dim]
    if (n // spec.tp_unit) % tp_size:
        raise SpecError(
            f"tensor {spec.name!r}: dimension {spec.tp_dim} of size {n} ({n // spec.tp_unit} units of "
            f"{spec.tp_unit}, e.g. attention heads) does not split evenly over TP size {tp_size}"
        )
    step = n // tp_size
    return tp_index * step, (tp_index + 1) * step


def shard_slice(spec: TensorSpec, tp_index: int, tp_size: int) -> Index:
    """Global index of the shard TP rank ``tp_index`` of a group of ``tp_size`` holds."""
    start, end = split_bounds(spec, tp_index, tp_size)
    if spec.tp_dim is None:
        return tuple(slice(0, d) for d in spec.shape)
    return tuple(slice(start, end) if d == spec.tp_dim else slice(0, n) for d, n in enumerate(spec.shape))


def shard_shape(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def stage_holds(plan: Plan, replica: int, stage: int, spec: TensorSpec) -> bool:
    """Whether pipeline stage ``stage`` of ``replica`` holds ``spec`` under ``plan``."""
    rep = plan.replicas[replica]
    n_virtual = len(rep.layers)
    if spec.where == "first":
        return stage == 0
    if spec.where == "last":
        return stage == (n_virtual - 1) % rep.pp
    if spec.where == "ends":
        return stage in (0, (n_virtual - 1) % rep.pp)
    assert spec.layer is not None
    for j, (lo, hi) in enumerate(rep.layer_ranges()):
        if lo <= spec.layer < hi:
            return j % rep.pp == stage
    raise SpecError(
        f"tensor {spec.name!r}: layer {spec.layer} is outside replica {replica}'s layers "
        f"(it runs {sum(rep.layers)}); the plan does not fit the model"
    )


def tensors_of_rank(plan: Plan, rank: int, specs: Sequence[TensorSpec]) -> list[tuple[TensorSpec, Index]]:
    """What ``rank`` holds under ``plan``: each tensor with the global index of its shard.

    A rank outside the plan's stages (a spare, or not in the plan at all) holds nothing.
    """
    if not plan.has_rank(rank):
        return []
    pos = plan.position(rank)
    return [
        (spec, shard_slice(spec, pos.tp_index, pos.tp_size))
        for spec in specs
        if stage_holds(plan, pos.replica, pos.stage, spec)
    ]


def check_plan_fits(plan: Plan, specs: Sequence[TensorSpec]) -> None:
    """Raise SpecError unless every replica covers every layer and every split divides evenly."""
    layers = sorted({s.layer for s in specs if s.layer is not None})
    for r_idx, rep in enumerate(plan.replicas):
        if sum(rep.layers) != len(layers):
            raise SpecError(f"plan: replica {r_idx} runs {sum(rep.layers)} layers, the model has {len(layers)}")
        for group in rep.stages:
            for spec in specs:
                split_bounds(spec, 0, len(group))
