"""Per-device memory of a plan: model state plus the activations the schedule keeps alive.

Bytes per parameter (mixed-precision AdamW, the Megatron / ZeRO-0 accounting):

    bf16 weights 2 + fp32 gradients 4 + fp32 master weights 4 + Adam m 4 + Adam v 4 = 18 B

A TP group of k devices splits a stage's weights k ways. Activations: one transformer layer
keeps ``34 · tokens · hidden`` bytes per micro-batch (Korthikanti et al. 2022, with flash
attention so the ``5·a·s²`` score term is gone), divided by k under sequence parallelism;
full recomputation keeps only the ``2 · tokens · hidden`` layer input. 1F1B keeps up to
``p − s`` micro-batches in flight on stage s (never more than the stage's share); the
interleaved schedule keeps Megatron's warm-up count of chunks. A reserve covers the CUDA
context, NCCL buffers and allocator fragmentation. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

from dataclasses import dataclass

from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError

GiB = 2**30


@dataclass(frozen=True)
class MemoryModel:
    weight_bytes: float = 2.0  # bf16 working copy
    grad_bytes: float = 4.0  # fp32 gradient accumulation
    optimizer_bytes: float = 12.0  # fp32 master + Adam first and second moments
    activation_coeff: float = 34.0  # bytes per token per hidden unit per layer (no recompute)
    recompute: bool = False  # full activation recomputation: keep only the layer input
    reserve_bytes: float = 4.0 * GiB

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "grad_bytes", "optimizer_bytes", "activation_coeff", "reserve_bytes"):
            if getattr(self, name) < 0:
                raise SpecError(f"memory model: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def state_bytes_per_param(self) -> float:
        """Everything a parameter costs while training (18 B by default)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def moved_bytes_per_param(self) -> float:
        """What a reconfiguration must ship per parameter: weights + optimizer state
        (gradients are zero at a step boundary)."""
        return self.weight_bytes + self.optimizer_bytes

    def activation_bytes_per_layer(self, spec: ModelSpec, tokens: int) -> float:
        """One layer, one micro-batch, whole (un-sharded) layer."""
        coeff = 2.0 if self.recompute else self.activation_coeff
        return coeff * tokens * spec.hidden


def inflight_microbatches(schedule: Schedule, pp: int, stage: int, microbatches: int, virtual_chunks: int = 1) -> float:
    """Micro-batches (in units of a whole stage's activations) alive at the peak on ``stage``."""
    if microbatches <= 0:
        return 0.0
    if schedule is Schedule.INTERLEAVED and virtual_chunks > 1:
        # Megatron's warm-up: 2·(p − s − 1) + (v − 1)·p + 1 chunks, each 1/v of the stage
        chunks = min(2 * (pp - stage - 1) + (virtual_chunks - 1) * pp + 1, microbatches * virtual_chunks)
        return chunks / virtual_chunks
    return float(min(pp - stage, microbatches))


def stage_device_bytes(
    spec: ModelSpec,
    mem: MemoryModel,
    *,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    inflight: float,
    tokens: int,
) -> float:
    """Peak bytes on one device of a stage's TP group."""
    params = layers * spec.params_per_layer()
    if first:
        params += spec.embedding_params()
    if last:
        params += spec.embedding_params() + spec.hidden  # LM head + final norm
    state = params * mem.state_bytes_per_param / tp
    act = inflight * layers * mem.activation_bytes_per_layer(spec, tokens) / tp
    if last:
        # logits of one micro-batch in fp32 (vocab-parallel over the TP group)
        act += 4.0 * tokens * spec.vocab / tp
    return state + act + mem.reserve_bytes


def max_layers_fitting(
    spec: ModelSpec,
    mem: MemoryModel,
    *,
    capacity_bytes: float,
    tp: int,
    first: bool,
    last: bool,
    inflight: float,
    tokens: int,
) -> int:
    """The most layers a stage can hold within ``capacity_bytes`` per device (may be 0 or
    negative when even the embeddings alone do not fit)."""
    fixed = stage_device_bytes(spec, mem, layers=0, tp=tp, first=first, last=last, inflight=inflight, tokens=tokens)
    per_layer = (
        spec.params_per_layer() * mem.state_bytes_per_param + inflight * mem.activation_bytes_per_layer(spec, tokens)
    ) / tp
    if fixed > capacity_bytes:
        return -1
    return int((capacity_bytes - fixed) // per_layer)
