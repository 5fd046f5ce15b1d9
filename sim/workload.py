"""Realistic training traces with known faults, for the detector's tests and benchmark.

Batches are real documents packed into fixed token budgets: the Python standard library's
``.py`` files (byte-level tokens, so a file's token count is its size in bytes), split at
the budget when longer, shuffled per epoch under a seed and packed greedily (next-fit) or
best-fit-decreasing within a window. Their lengths spread from a few hundred tokens to whole
32K budgets, like the code data sets the ResiHP paper trained on.

Timings come from a ground truth (``sim.workload_truth``) that deliberately is *not* the
detector's ``α·tokens + β·Σl² + γ`` model: FLOP counts at GEMM and flash-attention
efficiencies with 128-token attention tiles, per-document and per-layer launch overheads,
per-device efficiency spread and slow thermal drift, per-op jitter, OS-noise spikes, GC
pauses, data-loader stalls, periodic checkpoint stalls, communication jitter and congestion
spikes. Ops are placed by the pipeline schedule's own op order (``detector.program``, built
from ``schedule.orders``) with the ground-truth durations and per-device speeds.

Faults: compute fail-slows (a device runs ``factor``× slower), link fail-slows (a rank's NIC:
its P2P transfers and its DP ring run ``factor``× slower), path fail-slows (the network path
between two stages: the P2P transfers, both ways, between a rank and its neighbour of the next
stage — the previous one for a last stage —, its DP ring untouched), persistent or transient,
and fail-stops (an exit event, or just silence: heartbeats stop).
"""
from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.model.trace import (
    DeviceInfo,
    ExitEvent,
    HeartbeatEvent,
    IterationRecord,
    OpState,
    Record,
    TraceHeader,
    write_trace,
)

Evidence = Literal["chunks", "rank_step", "iteration"]
FaultKind = Literal["compute", "link", "path", "stop"]


# --- documents and packing ---------------------------------------------------------------
@lru_cache(maxsize=1)
def stdlib_document_lengths() -> tuple[int, ...]:
    """Byte-level token counts of the standard library's .py files, in path order."""
    root = sysconfig.get_paths()["stdlib"]
    sizes: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                size = os.path.getsize(path)
                if size > 0:
                    sizes.append((os.path.relpath(path, root), size))
    if not sizes:
        raise RuntimeError(f"no .py files under the standard library at {root}")
    return tuple(size for _, size in sorted(sizes))


def heavy_tail_document_lengths(count: int = 20000, median: int = 1024, sigma: float = 1.25,
                                seed: int = 0) -> tuple[int, ...]:
    """Document lengths with a heavy tail, as web text and code corpora have: lognormal
    around ``median`` tokens; at sigma 1.25 about one in a hundred is 16K tokens or more
    (packed at an 8K/16K budget such a document fills whole micro-batches)."""
    if count < 1 or median < 1 or not sigma > 0:
        raise ValueError(f"heavy_tail_document_lengths: count, median and sigma must be positive, got "
                         f"{count}, {median}, {sigma}")
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in np.maximum(1, np.rint(median * np.exp(rng.normal(0.0, sigma, count)))))


class BatchStream:
    """An endless, seeded stream of packed micro-batches (tuples of document lengths)."""

    def __init__(
        self, budget: int, method: str = "best-fit", seed: int = 0,
        lengths: Sequence[int] | None = None, window: int = 256,
    ) -> None:
        if budget < 1:
            raise ValueError(f"packing budget must be a positive token count, got {budget}")
        if method not in ("greedy", "best-fit"):
            raise ValueError(f"packing method must be 'greedy' or 'best-fit', got {method!r}")
        self.budget = budget
        self.method = method
        self.window = window
        self._rng = np.random.default_rng(seed)
        base = stdlib_document_lengths() if lengths is None else tuple(lengths)
        # a document longer than the budget becomes budget-sized pieces plus a remainder
        pieces: list[int] = []
        for n in base:
            full, rest = divmod(n, budget)
            pieces.extend([budget] * full)
            if rest:
                pieces.append(rest)
        self._pieces = np.asarray(pieces, dtype=np.int64)
        self._queue: list[tuple[int, ...]] = []

    def _epoch(self) -> None:
        docs = self._pieces[self._rng.permutation(len(self._pieces))].tolist()
        if self.method == "greedy":
            cur: list[int] = []
            used = 0
            for n in docs:
                if used + n > self.budget and cur:
                    self._queue.append(tuple(cur))
                    cur, used = [], 0
                cur.append(n)
                used += n
            if cur:
                self._queue.append(tuple(cur))
            return
        for lo in range(0, len(docs), self.window):
            bins: list[list[int]] = []
            free: list[int] = []
            for n in sorted(docs[lo:lo + self.window], reverse=True):
                best = -1
                for i, f in enumerate(free):
                    if n <= f and (best < 0 or f < free[best]):
                        best = i
                if best < 0:
                    bins.append([n])
                    free.append(self.budget - n)
                else:
                    bins[best].append(n)
                    free[best] -= n
            order = self._rng.permutation(len(bins))
            self._queue.extend(tuple(bins[i]) for i in order)

    def next(self) -> tuple[int, ...]:
        if not self._queue:
            self._epoch()
            self._queue.reverse()
        return self._queue.pop()

    def take(self, n: int) -> list[tuple[int, ...]]:
        return [self.next() for _ in range(n)]


# --- configuration -----------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """An injected fault. ``end_iter`` None = persistent; ``stop`` faults die at
    ``start_iter`` (with an exit event when ``exit_event``, else silently)."""

    kind: FaultKind
    rank: int
    start_iter: int
    factor: float = 1.0
    end_iter: int | None = None
    exit_event: bool = True
    # a `stop` without an exit event whose rank stays alive and beating, stuck inside a compute
    # op (a kernel or data loader that never returns); its peers block in p2p and collective
    # ops, and every heartbeat names the op its rank is in (OpState)
    stuck: bool = False

    def active(self, iteration: int) -> bool:
        return self.start_iter <= iteration and (self.end_iter is None or iteration < self.end_iter)


@dataclass(frozen=True)
class Noise:
    op_jitter: float = 0.010  # lognormal sigma of one compute op (healthy GPUs repeat to ~1 %)
    device_spread: float = 0.006  # fixed per-device efficiency spread (silicon, cooling)
    drift: float = 0.004  # amplitude of slow per-device thermal drift
    os_noise_prob: float = 0.003  # per op: an OS-noise hiccup
    os_noise_max: float = 0.25  # ... lengthening the op by up to this fraction
    gc_prob: float = 0.03  # per rank and iteration: a Python GC pause before some op
    gc_pause_s: tuple[float, float] = (0.02, 0.15)
    loader_prob: float = 0.03  # per replica and iteration: a data-loader stall before its first op
    loader_pause_s: tuple[float, float] = (0.2, 2.0)
    checkpoint_every: int = 50  # iterations between checkpoint stalls (0 = never)
    checkpoint_s: tuple[float, float] = (2.0, 6.0)
    comm_jitter: float = 0.04  # lognormal sigma of one transfer
    comm_spike_prob: float = 0.01  # per transfer: congestion
    comm_spike_max: float = 1.5  # ... up to this factor longer
    # a DP all-reduce span as a real runtime times it: from when *this* rank entered the
    # collective (its own pipeline end), so it holds the wait for the ring's last arriver
    dp_skew_wait: bool = True
    # co-tenant CPU load on a host (another job's data loading, a monitoring daemon): per node
    # and iteration the chance an episode starts; while it lasts every rank of the node runs
    # its ops up to cotenant_slowdown slower on average (host-side launches and syncs
    # wait for the CPU), with extra per-op jitter. A GPU-bound op barely notices: keep the
    # mean slowdown at a few per cent, which no re-plan can route around
    cotenant_prob: float = 0.0
    cotenant_iters: tuple[int, int] = (10, 60)
    cotenant_slowdown: float = 0.02
    cotenant_jitter: float = 0.05

    @classmethod
    def quiet(cls) -> Noise:
        """No pauses, stalls or spikes: only jitter (for unit tests)."""
        return cls(os_noise_prob=0.0, gc_prob=0.0, loader_prob=0.0, checkpoint_every=0, comm_spike_prob=0.0)

    @classmethod
    def everything(cls, comm_jitter: float = 0.04) -> Noise:
        """The realistic profile with every noise class on: jitter, OS noise, GC pauses,
        data-loader and checkpoint stalls, congestion, DP skew waiting and co-tenant
        episodes (starting on one node in 200 per iteration: a node is loaded ~15 % of the time), with P2P jitter ``comm_jitter`` (0-0.3)."""
        return cls(comm_jitter=comm_jitter, cotenant_prob=0.005)


@dataclass(frozen=True)
class Hardware:
    """An A100-class cluster."""

    gemm_flops: float = 190e12  # sustained dense bf16 GEMM
    attn_flops: float = 130e12  # flash attention, full 128x128 tiles
    tile: int = 128
    launch_s: float = 60e-6  # per layer and op: kernel launches, norms, elementwise
    doc_s: float = 3e-6  # per document per layer: varlen bookkeeping
    intra_node_Bps: float = 150e9
    inter_node_Bps: float = 22e9
    latency_s: float = 15e-6
    hbm_Bps: float = 1.5e12
    gpus_per_node: int = 8


@dataclass(frozen=True)
class WorkloadConfig:
    model: ModelSpec
    plan: Plan
    budget: int = 32768
    packing: str = "best-fit"
    seed: int = 0
    iterations: int = 100
    evidence: Evidence = "chunks"
    noise: Noise = field(default_factory=Noise)
    hardware: Hardware = field(default_factory=Hardware)
    faults: tuple[Fault, ...] = ()
    heartbeats: bool = True
    heartbeat_timeout_s: float = 30.0  # how long the trace runs on after a silent stop
    heartbeat_interval_s: float = 1.0  # a rank's heartbeats while the job hangs (the hooks beat every second)
    # heartbeats within every iteration, this many seconds apart, naming the op each rank is in
    # (0: none). The runtime's hooks beat every second: a 30 s iteration hears 30 of each rank
    op_beats_s: float = 0.0
    documents: tuple[int, ...] | None = None  # document lengths to pack (default: the stdlib's .py files)

    def __post_init__(self) -> None:
        ranks = set(self.plan.ranks())
        for f in self.faults:
            if f.rank not in ranks:
                raise ValueError(f"fault {f}: rank {f.rank} is not in the plan")
            if f.kind != "stop" and f.factor < 1.0:
                raise ValueError(f"fault {f}: a fail-slow factor must be >= 1")
            if f.kind == "path" and len(self.plan.replicas[self.plan.position(f.rank).replica].stages) < 2:
                raise ValueError(f"fault {f}: a path fault joins two pipeline stages; rank {f.rank}'s replica has one")
        if self.evidence not in ("chunks", "rank_step", "iteration"):
            raise ValueError(f"evidence must be chunks, rank_step or iteration, got {self.evidence!r}")


def make_header(cfg: WorkloadConfig, job: str = "sim") -> TraceHeader:
    per_node = cfg.hardware.gpus_per_node
    world = max(cfg.plan.ranks()) + 1
    devices = tuple(DeviceInfo(r, f"node{r // per_node:03d}", r % per_node) for r in range(world))
    return TraceHeader(
        model=cfg.model, plan=cfg.plan, devices=devices, job=job, tokens_per_microbatch=cfg.budget,
        meta={"generator": "resihp.sim.workload", "seed": cfg.seed, "packing": cfg.packing},
    )


def generate(cfg: WorkloadConfig) -> Iterator[IterationRecord | HeartbeatEvent | ExitEvent]:
    """Every record of the run in time order (no ``PlanChange``: the plan stays as configured)."""
    from resihp.sim.workload_truth import GroundTruth

    truth = GroundTruth(cfg)
    stop = next((f for f in sorted(cfg.faults, key=lambda f: f.start_iter) if f.kind == "stop"), None)
    ranks = cfg.plan.ranks()
    ops_done = {r: 0 for r in ranks}  # compute ops each rank entered so far (its op counter)
    now = 0.0
    for it in range(cfg.iterations):
        if stop is not None and it == stop.start_iter:
            t_die = now + 0.4 * truth.last_time_s
            if stop.exit_event:
                yield ExitEvent(stop.rank, t_die, -9)
            if cfg.heartbeats:  # the others keep beating while the job hangs
                beat = cfg.heartbeat_interval_s
                t = now
                ops = _stuck_ops(cfg, stop.rank) if stop.stuck else {}
                while t < t_die + 1.5 * cfg.heartbeat_timeout_s:
                    t += beat
                    for r in ranks:
                        if r != stop.rank or t < t_die or stop.stuck:
                            yield HeartbeatEvent(r, t, ops.get(r) if t >= t_die else None)
            return
        rec = truth.iteration(it, now)
        now = rec.start_s + rec.time_s
        if cfg.heartbeats and cfg.op_beats_s > 0:
            yield from _op_beats(cfg, rec, ops_done)
        yield rec
        if cfg.heartbeats:
            for r in ranks:
                yield HeartbeatEvent(r, now)


_BUSY = ("F", "B", "W", "OPT")


def _op_beats(cfg: WorkloadConfig, rec: IterationRecord, ops_done: dict[int, int]) -> Iterator[HeartbeatEvent]:
    """The heartbeats of the iteration ``rec`` (on the job's grid of ``op_beats_s``), each naming
    the op its rank is in, as the runtime's op cursor does: inside one of its compute spans it
    computes; a stage-0 rank before its first op loads data (between ops: it waits for nobody);
    in its DP span it waits in the all-reduce; anywhere else for a pipeline peer or a TP
    partner. Counts each rank's compute ops into ``ops_done``."""
    step = cfg.op_beats_s
    end = rec.start_s + rec.time_s
    first = math.floor(rec.start_s / step) + 1
    times = np.arange(first, math.ceil(end / step)) * step
    times = times[(times > rec.start_s) & (times < end)]
    if not len(times):
        for r in ops_done:
            ops_done[r] += sum(1 for c in rec.chunks if c.rank == r and c.kind in _BUSY)
        return
    by_rank: dict[int, list[tuple[float, float, str]]] = {r: [] for r in ops_done}
    dp: dict[int, tuple[float, float]] = {}
    for c in rec.chunks:
        if c.rank not in by_rank:
            continue
        if c.kind in _BUSY:
            by_rank[c.rank].append((rec.start_s + c.start_s, rec.start_s + c.end_s, f"{c.kind} mb{c.microbatch}"))
        elif c.kind == "DP":
            dp[c.rank] = (rec.start_s + c.start_s, rec.start_s + c.end_s)
    stage0 = {r for rep in cfg.plan.replicas for r in rep.stages[0]}
    states: dict[int, list[OpState]] = {}
    for r, spans in by_rank.items():
        spans.sort()
        starts = np.array([a for a, _, _ in spans])
        ends = np.array([b for _, b, _ in spans])
        j = np.searchsorted(starts, times, side="right") - 1
        base = ops_done[r]
        out = []
        for t, k in zip(times.tolist(), j.tolist()):
            if k >= 0 and t < ends[k]:
                out.append(OpState("compute", spans[k][2], False, base + k + 1))
            elif k < 0 and r in stage0:
                out.append(OpState("compute", "load batch", True, base))
            elif r in dp and dp[r][0] <= t < dp[r][1]:
                out.append(OpState("collective", "DP all-reduce", False, base + k + 1))
            else:
                out.append(OpState("p2p", "wait", False, base + max(k, 0) + 1 if k >= 0 else base))
        states[r] = out
        ops_done[r] += len(spans)
    for b, t in enumerate(times.tolist()):
        for r in by_rank:
            yield HeartbeatEvent(r, t, states[r][b])


def _stuck_ops(cfg: WorkloadConfig, stuck: int) -> dict[int, OpState]:
    """What each rank's heartbeats say while ``stuck`` hangs inside a forward: it is in that
    compute op; the other ranks of its replica wait for its activations or gradients (p2p),
    its TP partners in the layer's all-reduce, the other replicas in the DP all-reduce."""
    plan = cfg.plan
    where = plan.position(stuck)
    out: dict[int, OpState] = {}
    for d, rep in enumerate(plan.replicas):
        for s, group in enumerate(rep.stages):
            for r in group:
                if r == stuck:
                    out[r] = OpState("compute", "F mb2", False, 40)
                elif d != where.replica:
                    out[r] = OpState("collective", "DP all-reduce", False, 90)
                elif s == where.stage:
                    out[r] = OpState("collective", "TP all-reduce in F mb2", False, 41)
                else:
                    out[r] = OpState("p2p", "recv F mb2" if s > where.stage else "recv B mb0", False, 38)
    return out


def write_workload(cfg: WorkloadConfig, path: str, job: str = "sim") -> None:
    with open(path, "w", encoding="utf-8") as out:
        write_trace(out, make_header(cfg, job), generate(cfg))


def records_list(cfg: WorkloadConfig) -> list[Record]:
    return list(generate(cfg))


__all__ = [
    "BatchStream", "Evidence", "Fault", "Hardware", "Noise", "WorkloadConfig", "generate",
    "heavy_tail_document_lengths", "make_header", "records_list", "stdlib_document_lengths", "write_workload", "IterationRecord",
]
