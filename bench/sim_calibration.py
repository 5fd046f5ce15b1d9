"""bench/sim_vs_real.py's pure part: the machine calibrated from one reference run, the
simulator's predictions of every layout on it, and their error against the measurements.

The calibration describes the machine as a user describes a cluster (achieved FLOP/s of the
F and B chunks, the optimizer's memory bandwidth, a link line through a ping-pong); every
layout is then predicted with ``PerfModel.iteration_s`` and no per-layout fitting.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime import GLOBAL_MB, SEQ  # bench/runtime.py

from resihp.coordinator.model import costmodel
from resihp.coordinator.model.spec import ModelSpec, preset
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.world import World

REFERENCE = "single"
SHAPES = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}  # (tp, pp, dp)
ADAMW_BYTES_PER_PARAM = 28.0  # fp32 AdamW: reads param, grad, m, v; writes param, m, v
MODEL = "gpt-tiny"


@dataclass(frozen=True)
class Calibration:
    """This machine as a user would describe a cluster to the simulator."""

    reference: str  # the layout whose measurement calibrated the device
    device_flops: float
    device_mem_bw_Bps: float
    link_bw_Bps: float
    link_latency_s: float
    op_overhead_s: float = 0.0  # the runtime's own time per F or B op (outside the chunks)


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"sim_vs_real: {name} must be a finite number > 0, got {value!r} "
                         f"(a failed or empty measurement? re-run the real runs)")
    return float(value)


def fit_link(pingpong: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(bandwidth B/s, latency s) from (bytes, one-way seconds) pairs: least squares
    t = latency + bytes / bandwidth over at least two sizes."""
    pts = [(_positive("ping-pong bytes", b), _positive("ping-pong time", t)) for b, t in pingpong]
    if len({b for b, _ in pts}) < 2:
        raise ValueError("sim_vs_real: the ping-pong needs at least two message sizes to separate "
                         f"bandwidth from latency, got {sorted({b for b, _ in pts})}")
    mb = statistics.fmean(b for b, _ in pts)
    mt = statistics.fmean(t for _, t in pts)
    slope = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
    if slope <= 0:
        raise ValueError(f"sim_vs_real: ping-pong times do not grow with the message size ({pts}); "
                         "the measurement is noise — re-run it on a quieter machine")
    return 1.0 / slope, max(0.0, mt - slope * mb)


def microbatch_flops(spec: ModelSpec, seqlens: Sequence[int], layers: int, tp: int, first: bool,
                     last: bool) -> tuple[float, float]:
    """(forward, backward incl. weight grads) FLOPs of one micro-batch on one stage shard:
    the cost model's count, the same the perf model divides by the device's rate."""
    fl = costmodel.stage_flops(spec, seqlens, layers, tp, first=first, last=last)
    return fl.f, fl.b + fl.w


def calibrate(spec: ModelSpec, chunks: Sequence[tuple[str, Sequence[int], float]], opt_s: float,
              pingpong: Sequence[tuple[float, float]], reference: str = REFERENCE,
              op_overhead_s: float = 0.0) -> Calibration:
    """The device from a single-rank reference run. ``chunks``: (kind F|B, packed
    documents of the micro-batch, measured seconds) of every measured chunk; ``opt_s``: the
    median optimizer step. The optimizer's bandwidth is over the parameters the perf model
    counts for the whole model on one device (so the reference reproduces itself)."""
    if not chunks:
        raise ValueError("sim_vs_real: the reference run has no F/B chunks to calibrate the device on")
    flops = 0.0
    secs = 0.0
    for kind, seqlens, dur in chunks:
        if kind not in ("F", "B"):
            raise ValueError(f"sim_vs_real: reference chunk kind must be 'F' or 'B', got {kind!r}")
        f, b = microbatch_flops(spec, seqlens, spec.num_layers, 1, True, True)
        flops += f if kind == "F" else b
        secs += _positive(f"reference {kind} chunk time", dur)
    bw, lat = fit_link(pingpong)
    params = spec.num_layers * spec.params_per_layer() + spec.embedding_params()
    mem_bw = params * ADAMW_BYTES_PER_PARAM / _positive("reference optimizer time", opt_s)
    if not (math.isfinite(op_overhead_s) and op_overhead_s >= 0):
        raise ValueError(f"sim_vs_real: op_overhead_s must be a finite number >= 0, got {op_overhead_s!r}")
    return Calibration(reference, flops / secs, mem_bw, bw, lat, op_overhead_s)


def typical_seqlens(microbatches: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The perf model prices every micro-batch alike: the micro-batch whose attention work
    (Σ l²) is the median of the measured ones stands for all of them."""
    if not microbatches:
        raise ValueError("sim_vs_real: no measured micro-batches to take the typical document lengths from")
    ranked = sorted((sum(x * x for x in m), tuple(int(x) for x in m)) for m in microbatches)
    return ranked[len(ranked) // 2][1]


def job_for(layout: str, cal: Calibration, seqlens: Sequence[int], model: str = MODEL) -> JobSpec:
    """The JobSpec of a layout on the calibrated machine: two 'GPUs' in one node, fp32."""
    if layout not in SHAPES:
        raise ValueError(f"sim_vs_real: unknown layout {layout!r}; known: {', '.join(SHAPES)}")
    tp, pp, dp = SHAPES[layout]
    n = tp * pp * dp
    return JobSpec(
        model=preset(model), tp=tp, pp=pp, dp=dp, microbatches=GLOBAL_MB, tokens_per_microbatch=SEQ,
        seqlens=tuple(seqlens), gpus_per_node=n, device_flops=cal.device_flops,
        intra_node_bw_Bps=cal.link_bw_Bps, inter_node_bw_Bps=cal.link_bw_Bps,
        intra_node_latency_s=cal.link_latency_s, inter_node_latency_s=cal.link_latency_s,
        grad_bytes_per_param=4.0, activation_bytes_per_value=4.0, device_mem_bw_Bps=cal.device_mem_bw_Bps,
        optimizer_bytes_per_param=ADAMW_BYTES_PER_PARAM, op_overhead_s=cal.op_overhead_s,
    )


def predict(layout: str, cal: Calibration, seqlens: Sequence[int]) -> float:
    """The simulator's iteration time of ``layout`` (its healthy initial plan)."""
    job = job_for(layout, cal, seqlens)
    return float(PerfModel(job).iteration_s(job.initial_plan(), World(job.world_size, job.gpus_per_node)))


def model_terms(layout: str, cal: Calibration, seqlens: Sequence[int]) -> dict[str, float]:
    """The perf model's own split of an iteration: pipeline (compute + TP + P2P), DP sync, optimizer."""
    job = job_for(layout, cal, seqlens)
    pm = PerfModel(job)
    plan, world = job.initial_plan(), World(job.world_size, job.gpus_per_node)
    return {"pipeline_s": pm.replica_s(plan, 0, world), "dp_s": pm.dp_sync_s(plan, world),
            "opt_s": pm.optimizer_s(plan), "total_s": pm.iteration_s(plan, world)}


@dataclass(frozen=True)
class Row:
    layout: str
    real_s: float
    sim_s: float

    @property
    def error(self) -> float:
        return (self.sim_s - self.real_s) / self.real_s


def mape(rows: Sequence[Row]) -> float:
    if not rows:
        raise ValueError("sim_vs_real: no predicted layouts to score (only the reference was measured?)")
    for r in rows:
        _positive(f"measured iteration time of {r.layout}", r.real_s)
        _positive(f"simulated iteration time of {r.layout}", r.sim_s)
    return statistics.fmean(abs(r.error) for r in rows)


def compare(real_s: Mapping[str, float], cal: Calibration, seqlens: Sequence[int]) -> tuple[list[Row], Row]:
    """(rows of the predicted layouts, the reference's row)."""
    if cal.reference not in real_s:
        raise ValueError(f"sim_vs_real: the reference layout {cal.reference!r} has no measurement")
    rows = [Row(name, _positive(f"measured iteration time of {name}", t), predict(name, cal, seqlens))
            for name, t in real_s.items()]
    ref = next(r for r in rows if r.layout == cal.reference)
    return [r for r in rows if r.layout != cal.reference], ref
