"""Failure processes: fail-stops by cause at the Llama 3 rates, fail-slows from the
Greyhound statistics, accelerated scenarios, and replay of a failure trace file.

Fail-stops (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, Table 5): 419
unexpected interruptions in 54 days on 16,384 H100s ≈ 1.97e-5 per GPU-hour, with the cause
mix below. Each cause has a scope (``gpu``: one device is lost; ``node``: the whole host;
``process``: the process dies but the hardware is fine and comes back once the process is
relaunched) and a repair time (our assumption, documented in docs/simulate.md).

Fail-slows (Wu et al., Greyhound, ATC'25 §2): in a 10,000-GPU cluster 16 of 27 jobs of
≥ 512 GPUs met a fail-slow; computation fail-slows (throttling, CPU contention) are rare and
short (mean ≈ 10 min), communication fail-slows (congestion) frequent and longer
(mean ≈ 24 min), with a tail up to ~10 h; together they stretched job time 1.34× on average.
Durations are log-normal with those means (σ = 1.2 gives the heavy tail); magnitudes are
log-uniform over the ranges below. The arrival rates are our calibration (docs/simulate.md).

Trace files: JSON Lines, ``"format": 1`` (docs/failure-trace-format.md); malformed input
raises FailureTraceError naming the line and the field. Pure; randomness comes from a
seeded numpy Generator.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from resihp.sim.world import FailSlow, FailStop, Fault

FORMAT = 1
HOUR = 3600.0


@dataclass(frozen=True)
class Cause:
    name: str
    count: int  # interruptions in the Llama 3 54-day run
    scope: str  # gpu | node | process
    repair_s: float


# Llama 3 Table 5 (unexpected interruptions), scopes and repair times as we model them.
LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty-gpu", 148, "gpu", 4 * HOUR),
    Cause("gpu-hbm3", 72, "gpu", 4 * HOUR),
    Cause("software-bug", 54, "process", 120.0),
    Cause("network-switch-cable", 35, "node", 1 * HOUR),
    Cause("host-maintenance", 32, "node", 2 * HOUR),
    Cause("gpu-sram", 19, "gpu", 4 * HOUR),
    Cause("gpu-system-processor", 17, "gpu", 4 * HOUR),
    Cause("nic", 7, "node", 2 * HOUR),
    Cause("nccl-watchdog", 7, "process", 120.0),
    Cause("silent-data-corruption", 6, "gpu", 4 * HOUR),
    Cause("gpu-thermal", 6, "gpu", 1 * HOUR),
    Cause("other", 16, "node", 1 * HOUR),
)
LLAMA3_RATE_PER_GPU_HOUR = 419 / (54 * 24 * 16384)

# Greyhound: (share of fail-slow onsets, mean duration s, factor range)
COMPUTE_SLOW = (0.3, 10 * 60.0, (1.1, 3.0))
COMM_SLOW = (0.7, 24 * 60.0, (1.2, 6.0))
# onsets per GPU-hour: at 512 GPUs one every ~8 h, i.e. a 2-day job meets ~6; with the
# durations above that stretches an unmitigated job by roughly the reported 1.3x.
GREYHOUND_SLOW_RATE_PER_GPU_HOUR = 1.0 / (8 * 512)


class FailureTraceError(ValueError):
    def __init__(self, line: int, field: str, message: str) -> None:
        self.line = line
        self.field = field
        super().__init__(f"failure trace line {line}: field {field!r}: {message}")


# --- generators --------------------------------------------------------------------------
def _ranks_for(scope: str, rng: np.random.Generator, gpus: int, per_node: int) -> tuple[int, ...]:
    rank = int(rng.integers(gpus))
    if scope == "node":
        node = rank // per_node
        return tuple(range(node * per_node, (node + 1) * per_node))
    return (rank,)


def fail_stops(
    rng: np.random.Generator, gpus: int, per_node: int, horizon_s: float, *,
    rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR, every_s: float | None = None,
    repair_scale: float = 1.0, causes: Sequence[Cause] = LLAMA3_CAUSES,
) -> list[FailStop]:
    """Poisson arrivals at the given rate (or exactly one every ``every_s``: the paper's
    accelerated scenarios), causes drawn from the Llama 3 mix."""
    weights = np.array([c.count for c in causes], dtype=float)
    weights /= weights.sum()
    out: list[FailStop] = []
    t = 0.0
    while True:
        if every_s is not None:
            t += every_s
        else:
            t += float(rng.exponential(HOUR / (rate_per_gpu_hour * gpus)))
        if t >= horizon_s:
            return out
        c = causes[int(rng.choice(len(causes), p=weights))]
        out.append(FailStop(t, _ranks_for(c.scope, rng, gpus, per_node), c.name, c.scope, c.repair_s * repair_scale))


def fail_slows(
    rng: np.random.Generator, gpus: int, per_node: int, horizon_s: float, *,
    rate_per_gpu_hour: float = GREYHOUND_SLOW_RATE_PER_GPU_HOUR, every_s: float | None = None,
    compute_share: float = COMPUTE_SLOW[0], duration_scale: float = 1.0,
    compute_range: tuple[float, float] = COMPUTE_SLOW[2], comm_range: tuple[float, float] = COMM_SLOW[2],
) -> list[FailSlow]:
    """Fail-slow onsets with Greyhound's kind mix, durations and magnitudes."""
    out: list[FailSlow] = []
    t = 0.0
    sigma = 1.2
    while True:
        if every_s is not None:
            t += every_s
        else:
            t += float(rng.exponential(HOUR / (rate_per_gpu_hour * gpus)))
        if t >= horizon_s:
            return out
        compute = bool(rng.random() < compute_share)
        mean_s = COMPUTE_SLOW[1] if compute else COMM_SLOW[1]
        lo, hi = compute_range if compute else comm_range
        mu = math.log(mean_s * duration_scale) - sigma * sigma / 2
        duration = float(rng.lognormal(mu, sigma))
        factor = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        rank = int(rng.integers(gpus))
        if compute:
            out.append(FailSlow(t, (rank,), max(1.0, factor), duration, "compute", "gpu-throttling"))
        else:
            node = rank // per_node
            ranks = tuple(range(node * per_node, (node + 1) * per_node))
            out.append(FailSlow(t, ranks, max(1.0, factor), duration, "communication", "network-congestion"))


# --- trace files -------------------------------------------------------------------------
def dump_trace(faults: Iterable[Fault], out: IO[str], gpus: int, per_node: int, description: str = "") -> None:
    out.write(json.dumps({"format": FORMAT, "type": "header", "gpus": gpus, "gpus_per_node": per_node,
                          "description": description}) + "\n")
    for f in sorted(faults, key=lambda x: x.time_s):
        if isinstance(f, FailStop):
            rec: dict[str, Any] = {"type": "fail-stop", "time_s": round(f.time_s, 3), "ranks": list(f.ranks),
                                   "cause": f.cause, "scope": f.scope}
            if math.isfinite(f.repair_s):
                rec["repair_s"] = round(f.repair_s, 3)
        else:
            rec = {"type": "fail-slow", "time_s": round(f.time_s, 3), "ranks": list(f.ranks), "kind": f.slow_kind,
                   "factor": round(f.factor, 4), "duration_s": round(f.duration_s, 3), "cause": f.cause}
        out.write(json.dumps(rec) + "\n")


def _num(obj: Mapping[str, Any], key: str, line: int, *, positive: bool = False, default: float | None = None) -> float:
    if key not in obj:
        if default is not None:
            return default
        raise FailureTraceError(line, key, "missing")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FailureTraceError(line, key, f"must be a finite number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise FailureTraceError(line, key, f"must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _ranks(obj: Mapping[str, Any], line: int, gpus: int, per_node: int) -> tuple[int, ...]:
    if ("ranks" in obj) == ("node" in obj):
        raise FailureTraceError(line, "ranks", "give exactly one of 'ranks' (a list of GPU ranks) or 'node' (an index)")
    if "node" in obj:
        node = obj["node"]
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < gpus // per_node:
            raise FailureTraceError(line, "node", f"must be a node index in 0..{gpus // per_node - 1}, got {node!r}")
        return tuple(range(node * per_node, (node + 1) * per_node))
    raw = obj["ranks"]
    if not isinstance(raw, list) or not raw:
        raise FailureTraceError(line, "ranks", f"must be a non-empty list of GPU ranks, got {raw!r}")
    for r in raw:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < gpus:
            raise FailureTraceError(line, "ranks", f"rank {r!r} is outside the job's GPUs 0..{gpus - 1}")
    return tuple(sorted(set(raw)))


def parse_trace(lines: Iterable[str], gpus: int, per_node: int) -> list[Fault]:
    """Read a failure trace for a job of ``gpus`` GPUs (``per_node`` to a node)."""
    faults: list[Fault] = []
    header_seen = False
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FailureTraceError(n, "json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise FailureTraceError(n, "type", "each line must be a JSON object")
        if not header_seen:
            if obj.get("type") != "header":
                raise FailureTraceError(n, "type", "the first line must be the header {\"format\": 1, \"type\": \"header\"}")
            if obj.get("format") != FORMAT:
                raise FailureTraceError(n, "format", f"unsupported format {obj.get('format')!r}; this version reads {FORMAT}")
            want = obj.get("gpus")
            if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want > gpus):
                raise FailureTraceError(n, "gpus", f"the trace is for {want!r} GPUs but the job has {gpus}; "
                                                   f"run with --gpus {want} or regenerate the trace")
            header_seen = True
            continue
        kind = obj.get("type")
        t = _num(obj, "time_s", n)
        ranks = _ranks(obj, n, gpus, per_node)
        cause = obj.get("cause", "unknown")
        if not isinstance(cause, str):
            raise FailureTraceError(n, "cause", f"must be a string, got {cause!r}")
        if kind == "fail-stop":
            scope = obj.get("scope", "node" if "node" in obj else "gpu")
            if scope not in ("gpu", "node", "process"):
                raise FailureTraceError(n, "scope", f"must be gpu, node or process, got {scope!r}")
            repair = _num(obj, "repair_s", n, default=math.inf) if obj.get("repair_s") is not None else math.inf
            faults.append(FailStop(t, ranks, cause, scope, repair))
        elif kind == "fail-slow":
            slow_kind = obj.get("kind")
            if slow_kind not in ("compute", "communication"):
                raise FailureTraceError(n, "kind", f"must be 'compute' or 'communication', got {slow_kind!r}")
            factor = _num(obj, "factor", n, positive=True)
            if factor < 1.0:
                raise FailureTraceError(n, "factor", f"is a slowdown (>= 1; 2 = twice as slow), got {factor}")
            faults.append(FailSlow(t, ranks, factor, _num(obj, "duration_s", n, positive=True), slow_kind, cause))
        else:
            raise FailureTraceError(n, "type", f"unknown record type {kind!r}; expected fail-stop or fail-slow")
    if not header_seen:
        raise FailureTraceError(1, "header", "the trace is empty")
    return faults


def load_trace(path: str, gpus: int, per_node: int) -> list[Fault]:
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh, gpus, per_node)
