"""Model shapes: the one description of a transformer every pure module shares.

Pure: no torch, grpc or MPI. Presets follow the published configs of the models the
ResiHP evaluation used, plus a tiny GPT that trains on two CPU cores.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


class SpecError(ValueError):
    """A model spec or plan that cannot work; the message says what and how to fix it."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    num_kv_heads < num_heads means grouped-query attention; gated_mlp means SwiGLU (three
    FFN matrices instead of two).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    vocab: int
    num_kv_heads: int = 0  # 0 = same as num_heads
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            raise SpecError(
                f"model {self.name!r}: hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise SpecError(f"model {self.name!r}: num_kv_heads ({kv}) must divide num_heads ({self.num_heads})")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def params_per_layer(self) -> int:
        """Weights of one transformer layer (attention + MLP + two norms)."""
        h = self.hidden
        kv_dim = self.kv_heads * self.head_dim
        attention = h * h + 2 * h * kv_dim + h * h  # Q, K, V, output projection
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        return attention + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        # untied input and output embeddings, as in LLaMA
        return self.num_layers * self.params_per_layer() + 2 * self.embedding_params()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"model must be an object, got {type(data).__name__}")
        if "preset" in data and len(data) == 1:
            return preset(str(data["preset"]))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"model: unknown field(s) {unknown}; known fields are {sorted(known)}")
        missing = sorted(k for k in ("name", "num_layers", "hidden", "num_heads", "ffn_hidden", "vocab") if k not in data)
        if missing:
            raise SpecError(f"model: missing field(s) {missing}")
        return cls(**dict(data))


PRESETS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, 11008, 32000, gated_mlp=True),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, 13824, 32000, gated_mlp=True),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 28672, 32000, num_kv_heads=8, gated_mlp=True),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 18944, 152064, num_kv_heads=4, gated_mlp=True),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 80, 8192, 64, 29568, 152064, num_kv_heads=8, gated_mlp=True),
    # trains on two CPU cores; byte-level vocabulary
    "gpt-tiny": ModelSpec("gpt-tiny", 8, 64, 4, 256, 256),
}


SHAPE_FIELDS = ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab", "kv_heads", "gated_mlp")


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs describe the same model (names may differ)."""
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE_FIELDS)


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
