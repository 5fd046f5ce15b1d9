"""A GPT built from tensor-parallel layers; a pipeline stage is a contiguous layer range.

Pre-LayerNorm, learned absolute positions, GELU MLP, untied LM head. Parameter names
follow the layout contract (trainer_hooks/runtime/layout.py, described in docs/runtime.md):
``embed``, ``pos_embed``, ``layers.{i}.…`` with the GLOBAL layer index i, ``final_ln``,
``lm_head``. One micro-batch is one packed row of T tokens holding several documents;
attention is causal within each document only and positions restart per document.

Initialisation is layout-free: every global tensor is drawn from its own generator seeded
by (seed, name), and a rank keeps its TP slice, so any layout starts from the same weights.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.runtime.tp_layers import SINGLE, ColumnParallelLinear, RowParallelLinear, TPContext


def tp_split_dim(name: str) -> int | None:
    """The dimension a TP group splits this parameter along (None = replicated)."""
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias")):
        return 0
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return 1
    return None


def global_shape(spec: ModelSpec, max_seq_len: int, name: str) -> tuple[int, ...]:
    h, ffn = spec.hidden, spec.ffn_hidden
    if name == "embed.weight" or name == "lm_head.weight":
        return (spec.vocab, h)
    if name == "pos_embed.weight":
        return (max_seq_len, h)
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    shapes = {
        "ln1.weight": (h,), "ln1.bias": (h,), "ln2.weight": (h,), "ln2.bias": (h,),
        "final_ln.weight": (h,), "final_ln.bias": (h,),
        "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
        "attn.proj.weight": (h, h), "attn.proj.bias": (h,),
        "mlp.fc1.weight": (ffn, h), "mlp.fc1.bias": (ffn,),
        "mlp.fc2.weight": (h, ffn), "mlp.fc2.bias": (h,),
    }
    try:
        return shapes[leaf]
    except KeyError:
        raise SpecError(f"model: unknown parameter name {name!r}") from None


def init_full_tensor(spec: ModelSpec, max_seq_len: int, name: str, seed: int) -> torch.Tensor:
    """The unsharded initial value of one parameter (GPT-2 style), independent of layout."""
    shape = global_shape(spec, max_seq_len, name)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "ln" in name.rsplit(".", 2)[-2]:  # ln1, ln2, final_ln weights
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        std /= math.sqrt(2 * spec.num_layers)  # residual projections scaled by depth
    return torch.randn(shape, generator=gen) * std


def shard_of(full: torch.Tensor, dim: int | None, tp: TPContext) -> torch.Tensor:
    if dim is None or tp.size == 1:
        return full.clone()
    n = full.shape[dim]
    step = n // tp.size
    return full.narrow(dim, tp.index * step, step).clone()


@dataclass(frozen=True)
class PackedMeta:
    """Per-micro-batch attention metadata derived from the packed documents' lengths."""

    mask: torch.Tensor  # [T, T] bool, True = may attend
    positions: torch.Tensor  # [T] int64, restarting at 0 in every document

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int], device: torch.device | str = "cpu") -> PackedMeta:
        lens = torch.tensor(list(seqlens), dtype=torch.int64, device=device)
        total = int(lens.sum())
        doc = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(total, device=device) - starts[doc]
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        return cls(mask=causal & (doc[:, None] == doc[None, :]), positions=positions)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext) -> None:
        super().__init__()
        if spec.num_heads % tp.size:
            raise SpecError(f"model: TP size {tp.size} must divide the head count ({spec.num_heads})")
        if spec.kv_heads != spec.num_heads:
            raise SpecError("model: this runtime's GPT uses multi-head attention (num_kv_heads = num_heads)")
        self.local_heads = spec.num_heads // tp.size
        self.head_dim = spec.head_dim
        # rows are head-major ([q_h; k_h; v_h] per head), so a contiguous TP slice is whole heads
        self.qkv = ColumnParallelLinear(spec.hidden, 3 * spec.hidden, tp)
        self.proj = RowParallelLinear(spec.hidden, spec.hidden, tp)

    def forward(self, x: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, self.local_heads, 3, self.head_dim)
        q, k, v = (part.transpose(0, 1) for part in qkv.unbind(2))  # [heads, T, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask)
        return self.proj(out.transpose(0, 1).reshape(t, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext) -> None:
        super().__init__()
        if spec.gated_mlp:
            raise SpecError("model: this runtime's GPT uses a GELU MLP (gated_mlp = false)")
        self.fc1 = ColumnParallelLinear(spec.hidden, spec.ffn_hidden, tp)
        self.fc2 = RowParallelLinear(spec.ffn_hidden, spec.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = Attention(spec, tp)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec, tp)

    def forward(self, x: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), meta)
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """Layers [start, end) of the GPT; the first stage embeds, the last one has the head."""

    def __init__(
        self, spec: ModelSpec, max_seq_len: int, layer_range: tuple[int, int], first: bool, last: bool,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__()
        start, end = layer_range
        if not 0 <= start < end <= spec.num_layers:
            raise SpecError(f"model: layer range [{start}, {end}) is outside 0..{spec.num_layers}")
        if spec.vocab < 256:
            raise SpecError(f"model: byte-level data needs vocab >= 256, got {spec.vocab}")
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.layer_range = layer_range
        self.first = first
        self.last = last
        self.tp = tp
        if first:
            self.embed = nn.Embedding(spec.vocab, spec.hidden)
            self.pos_embed = nn.Embedding(max_seq_len, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, tp) for i in range(start, end)})
        if last:
            self.final_ln = nn.LayerNorm(spec.hidden)
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    @torch.no_grad()
    def init_from_seed(self, seed: int) -> None:
        for name, param in self.named_parameters():
            full = init_full_tensor(self.spec, self.max_seq_len, name, seed)
            param.copy_(shard_of(full, tp_split_dim(name), self.tp))

    def forward(self, x: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        """First stage: x = token ids [T]; otherwise hidden states [T, H]. Last stage returns logits."""
        if self.first:
            if int(meta.positions.max()) >= self.max_seq_len:
                raise SpecError(f"model: a document position exceeds max_seq_len ({self.max_seq_len})")
            x = self.embed(x) + self.pos_embed(meta.positions)
        for block in self.layers.values():
            x = block(x, meta)
        if self.last:
            x = self.lm_head(self.final_ln(x))
        return x


IGNORE = -100  # a target that adds no loss and exactly zero gradient (a padding micro-batch's, data.py)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy; the runtime divides by the global batch's token count."""
    return F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE)
