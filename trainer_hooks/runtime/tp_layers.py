"""Megatron-style tensor-parallel linear layers.

A column-parallel linear holds rows ``[t·n/k, (t+1)·n/k)`` of the weight (its output is
split across the TP group); a row-parallel linear holds the matching columns (its input is
split) and all-reduces its partial products. The two conjugate autograd functions make
the pair exact: ``f`` is the identity forward and an all-reduce backward (in front of a
column-parallel layer, whose input gradient is partial on every rank), ``g`` is an
all-reduce forward and the identity backward (after a row-parallel layer). With a TP group
of one both are the identity and no collective runs.

Hugging Face plans name two more forms, for models whose code between the layers needs
whole tensors (Phi-3's fused qkv split by sizes, OLMo-2's norm over all heads): a
column-parallel layer that gathers its output (``colwise_gather_output``) and a row-parallel
one that takes a whole input and uses its own slice (``rowwise_split_input``). A replicated
module whose gradient is partial per rank (Qwen3's per-head ``q_norm``) has its gradient
summed over the group (``sum_grad_over_tp``).

Every TP collective adds its wall time to a process-wide counter (``collective_seconds``),
or on a GPU a pair of CUDA events around it to a list the op takes (``take_cuda_spans``):
the pipeline records, per F or B op, how much of the op was spent inside them, so the
detector can tell the TP member that is slow from the partners that wait for it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from resihp.trainer_hooks.reporting.opcursor import CURSOR
from resihp.trainer_hooks.runtime.chunk_clock import cuda_mark

_COLLECTIVE_S = [0.0]  # wall seconds this process has spent inside TP all-reduces
# on a GPU: (before, after) CUDA events around each TP all-reduce on the compute stream, since
# the op that takes them began (the host returns from an NCCL all-reduce once it is queued)
_CUDA_SPANS: list[tuple[Any, Any]] = []


def collective_seconds() -> float:
    """Wall seconds spent inside TP collectives so far (differences of two readings time one op)."""
    return _COLLECTIVE_S[0]


def cuda_spans_mark() -> int:
    """Where the TP all-reduces of an op that starts now will begin in the event list."""
    return len(_CUDA_SPANS)


def take_cuda_spans(first: int) -> list[tuple[Any, Any]]:
    """The event pairs of the all-reduces since ``first``; the list is emptied (pairs left by an
    op that failed are dropped with it)."""
    spans = _CUDA_SPANS[first:]
    _CUDA_SPANS.clear()
    return spans


def _timed(t: torch.Tensor, name: str, run: Any) -> None:
    """Run the TP collective ``run()`` on ``t``'s device, its time counted (see the module doc)."""
    if t.is_cuda:
        before = cuda_mark()
        run()
        _CUDA_SPANS.append((before, cuda_mark()))  # the compute stream waits for the collective there
        return
    start = time.perf_counter()
    with CURSOR.op("collective", name):
        run()
    _COLLECTIVE_S[0] += time.perf_counter() - start


def _timed_all_reduce(t: torch.Tensor, group: Any) -> None:
    if t.is_meta:  # a shape check of a sharded module (usermodel's spec validation): nothing to sum
        return
    _timed(t, "TP all-reduce", lambda: dist.all_reduce(t, group=group))


def _all_gather_last(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The TP group's ``x`` side by side on the last dimension (rank order)."""
    if x.is_meta:
        return torch.cat([x] * size, dim=-1)
    local = x.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    _timed(local, "TP all-gather", lambda: dist.all_gather(parts, local, group=group))
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TPContext:
    """A rank's place in its tensor-parallel group (group None = a group of one)."""

    group: Any  # torch.distributed.ProcessGroup | None
    index: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size:
            raise ValueError(f"TP index {self.index} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a TP group of size {self.size} needs a process group")


SINGLE = TPContext(group=None)


class _PendingGroup:
    """Stands for a TP group that does not exist yet: a stage built ahead of a switch (before
    the new epoch's groups) holds it until ``bind_tp``. Any collective on it is a bug."""

    def __repr__(self) -> str:
        return "<TP group not bound yet>"


def pending_tp(index: int, size: int) -> TPContext:
    """The TP place of a stage module built before its groups exist (see ``bind_tp``)."""
    return TPContext(group=_PendingGroup() if size > 1 else None, index=index, size=size)


def tp_modules(module: nn.Module) -> list[nn.Module]:
    """The sub-modules of ``module`` (itself included) that hold a TP place."""
    return [m for m in module.modules() if isinstance(getattr(m, "tp", None), TPContext)]


def bind_tp(module: nn.Module, tp: TPContext, layers: Sequence[nn.Module] | None = None) -> None:
    """Give every layer of ``module`` its real TP group; the place must match the one it was built for.
    ``layers``: ``tp_modules(module)``, if known (saves walking the module tree)."""
    for sub in (tp_modules(module) if layers is None else layers):
        old = sub.tp
        if (old.index, old.size) != (tp.index, tp.size):
            raise ValueError(f"a module built for TP place {old.index}/{old.size} cannot take place "
                             f"{tp.index}/{tp.size}")
        object.__setattr__(sub, "tp", tp)  # a plain attribute: skip nn.Module's slower __setattr__


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        _timed_all_reduce(out, ctx.group)
        return out, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        _timed_all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the last dimension forward (a column-parallel layer's output made whole);
    backward, this rank's slice of the gradient: what follows runs replicated, so every rank
    holds the same whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        ctx.width = x.shape[-1]
        return _all_gather_last(x, tp.group, tp.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        w, i = ctx.width, ctx.tp.index
        return grad[..., i * w:(i + 1) * w].contiguous(), None


class _SplitToTP(torch.autograd.Function):
    """This rank's slice of the last dimension forward (a whole input to a row-parallel layer);
    backward, the slices' gradients gathered: the input was whole on every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        w = _split(x.shape[-1], tp, "input features")
        return x[..., tp.index * w:(tp.index + 1) * w]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last(grad, ctx.tp.group, ctx.tp.size), None


def gather_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def split_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _SplitToTP.apply(x, tp)


def sum_grad_over_tp(module: nn.Module, tp: TPContext, recurse: bool = True) -> None:
    """A replicated module whose parameters' gradients are partial on each TP rank (a per-head
    norm between a column- and a row-parallel layer sees this rank's heads only): each
    gradient is summed over the group as it is computed, before it is accumulated, so
    micro-batches accumulate whole gradients. The module holds its TP place (``bind_tp``
    gives it the real group later). ``recurse``: its sub-modules' parameters too."""
    object.__setattr__(module, "tp", tp)

    def summed(grad: torch.Tensor) -> torch.Tensor:
        place: TPContext = module.tp  # pyright: ignore[reportAssignmentType]  # set above, rebound by bind_tp
        if place.size == 1:
            return grad
        out = grad.contiguous().clone()
        _timed_all_reduce(out, place.group)
        return out

    for p in module.parameters(recurse=recurse):
        if p.requires_grad:
            p.register_hook(summed)


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


def _split(n: int, tp: TPContext, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} ({n}) is not divisible by the TP size ({tp.size})")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y_t = x · W_tᵀ + b_t, W_t = rows of W for TP rank t (output split)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext = SINGLE, bias: bool = True,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output  # the output made whole again (colwise_gather_output)
        local = _split(out_features, tp, "output features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)
        return gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = Σ_t x_t · W_tᵀ + b, W_t = columns of W for TP rank t (input split); b added once."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext = SINGLE, bias: bool = True,
                 split_input: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.split_input = split_input  # takes a whole input, uses its own slice (rowwise_split_input)
        local = _split(in_features, tp, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = split_to_tp(x, self.tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class FusedColumnParallelLinear(nn.Module):
    """A column-parallel linear whose output is ``parts`` tensors side by side (nanoGPT's
    ``c_attn``: q, k and v in one matmul). TP rank t holds rows ``[t·n/k, (t+1)·n/k)`` of every
    part, so its output is its own slice of each part, side by side again. The weight is kept
    as ``[parts, rows, in]`` (the bias ``[parts, rows]``): the layout's logical shape, in which a
    rank's shard is one interval on dimension 1, as the reshard planner needs."""

    def __init__(self, in_features: int, out_features: int, parts: int, tp: TPContext = SINGLE,
                 bias: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.parts = parts
        if out_features % parts:
            raise ValueError(f"output features ({out_features}) do not split into {parts} parts")
        local = _split(out_features // parts, tp, "output features of one part")
        self.weight = nn.Parameter(torch.empty(parts, local, in_features))
        self.bias = nn.Parameter(torch.empty(parts, local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.reshape(-1)
        return F.linear(copy_to_tp(x, self.tp), self.weight.reshape(-1, self.in_features), bias)
