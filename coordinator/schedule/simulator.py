"""Pipeline schedule simulator and closed forms. Pure: numpy only, deterministic.

``simulate_pipeline`` runs one replica's schedule as a dependency graph:

* ops on a device run in the schedule's fixed order (``schedule.orders``), one at a time;
* F(v, i) waits for F(v-1, i) of the previous virtual stage (+ ``p2p_s`` when that stage
  is on another device);
* B(v, i) waits for B(v+1, i) (+ ``p2p_s``); the last virtual stage's B waits for its own F;
* W(v, i) waits for B(v, i) (same device);
* an op starts at max(its device is free, its dependency is done); its duration is the
  given one divided by its device's speed factor.

Time 0 is the start of the first forward. For 1F1B and interleaved 1F1B the backward is
one op (B carries B + W: pass ``w=None`` or a ``w`` that is added to ``b``); ZB-H1 needs
``w``.

``simulate_iteration(schedule, replicas, *, dp_sync_s=0.0, optimizer_s=0.0, p2p_s=0.0,
virtual_chunks=1)`` simulates every data-parallel replica (a ``ReplicaWork``, or a tuple
``(f, b, w)`` whose pipeline depth is ``len(f) // virtual_chunks``) independently, then:

    iteration_s = max over replicas of makespan + dp_sync_s + optimizer_s

i.e. the gradient all-reduce starts once the slowest replica has finished its last
backward (it is not overlapped with the pipeline) and the optimizer step follows it.
A replica with no micro-batches has makespan 0.

Bubble conventions: ``PipelineResult.bubble_fraction`` is mean idle / makespan (share of
the iteration's device time wasted, (p-1)/(m+p-1) for 1F1B); ``PipelineResult.bubble_ratio``
and the ``bubble_fraction_*`` closed forms are the papers' bubble / ideal compute
((p-1)/m for 1F1B).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt

from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.schedule.orders import B, F, Orders, W, orders_for

FloatArray = npt.NDArray[np.float64]
Durations = Sequence[Sequence[float]]
KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Op:
    stage: int  # device (pipeline stage) index
    kind: str  # "F", "B", "W"
    microbatch: int
    chunk: int  # virtual chunk index on that device (interleaved), else 0
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    makespan_s: float  # time from first F start to last op end on the pipeline
    busy_s: tuple[float, ...]  # per stage (device)
    idle_s: tuple[float, ...]  # per stage: makespan - busy
    bubble_fraction: float  # mean idle / makespan
    pp: int
    virtual_chunks: int
    microbatches: int
    # flat per-op arrays (op id = ((kind·V) + vstage)·m + mb), kept so ops are built lazily
    _start: FloatArray = field(repr=False, compare=False)
    _end: FloatArray = field(repr=False, compare=False)
    _pred: tuple[int, ...] = field(repr=False, compare=False)
    _orders: Orders = field(repr=False, compare=False)

    @property
    def bubble_ratio(self) -> float:
        """Mean idle / mean busy: the papers' bubble over ideal compute ((p-1)/m for 1F1B)."""
        busy = sum(self.busy_s)
        return sum(self.idle_s) / busy if busy > 0 else 0.0

    def _ops_of(self, ids: Sequence[int]) -> tuple[Op, ...]:
        # decoded with numpy: ops are built lazily and in bulk, the simulation never needs them
        idx = np.asarray(ids, dtype=np.int64)
        n_virtual = self.pp * self.virtual_chunks
        kind, rest = np.divmod(idx, n_virtual * self.microbatches)
        vstage, mb = np.divmod(rest, self.microbatches)
        return tuple(
            Op(st, KINDS[k], b, c, s0, s1)
            for st, k, b, c, s0, s1 in zip(
                (vstage % self.pp).tolist(), kind.tolist(), mb.tolist(), (vstage // self.pp).tolist(),
                self._start[idx].tolist(), self._end[idx].tolist(),
            )
        )

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every scheduled op, device by device, each device's ops in execution order."""
        return self._ops_of([op for order in self._orders for op in order])

    def device_ops(self, stage: int) -> tuple[Op, ...]:
        """The ops of one device, in execution order."""
        return self._ops_of(self._orders[stage])

    @cached_property
    def critical_path(self) -> tuple[Op, ...]:
        """Ops on the critical path, in time order: from the op that ends last, follow the
        constraint that set each start (device predecessor or data dependency)."""
        if not self._orders or not any(self._orders):
            return ()
        op = int(np.argmax(self._end))
        path: list[int] = []
        while op >= 0:
            path.append(op)
            op = self._pred[op]
        return self._ops_of(path[::-1])

    def vstage_of(self, op: Op) -> int:
        return op.chunk * self.pp + op.stage


@lru_cache(maxsize=256)
def _graph(n_virtual: int, pp: int, m: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Data dependency of every op id (-1: none) and whether it crosses devices."""
    n = 3 * n_virtual * m
    dep = [-1] * n
    cross = [False] * n
    for vs in range(n_virtual):
        for mb in range(m):
            f = (F * n_virtual + vs) * m + mb
            b = (B * n_virtual + vs) * m + mb
            w = (W * n_virtual + vs) * m + mb
            if vs > 0:
                dep[f] = f - m
                cross[f] = (vs - 1) % pp != vs % pp
            if vs < n_virtual - 1:
                dep[b] = b + m
                cross[b] = (vs + 1) % pp != vs % pp
            else:
                dep[b] = f
            dep[w] = b
    return tuple(dep), tuple(cross)


def _durations(name: str, d: Durations, n_virtual: int, m: int) -> FloatArray:
    try:
        arr = np.asarray(d, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a [virtual_stage][microbatch] table of numbers ({exc})") from None
    if arr.size == 0 and n_virtual * m == 0:
        return np.zeros((n_virtual, m))
    if arr.shape != (n_virtual, m):
        raise ValueError(
            f"{name}: expected shape (virtual stages={n_virtual}, micro-batches={m}), got {arr.shape}; "
            f"give one row per virtual stage (pp × virtual_chunks) and one column per micro-batch"
        )
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        vs, mb = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{vs}][{mb}] = {float(arr[vs, mb])!r}: durations must be finite and >= 0 seconds")
    return arr


def simulate_pipeline(
    schedule: Schedule,
    f: Durations,
    b: Durations,
    w: Durations | None = None,
    *,
    pp: int,
    virtual_chunks: int = 1,
    p2p_s: float = 0.0,
    speed: Sequence[float] | None = None,
) -> PipelineResult:
    """Simulate one replica. ``f[v][i]``, ``b[v][i]``, ``w[v][i]``: durations (seconds, at
    speed 1) of virtual stage v (pp · virtual_chunks rows, model order) on micro-batch i.
    ``speed[s]`` divides the durations of device s. See the module docstring."""
    schedule = Schedule(schedule)
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pp must be a positive integer, got {pp!r}")
    v = virtual_chunks
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"virtual_chunks must be a positive integer, got {v!r}")
    if v > 1 and schedule is not Schedule.INTERLEAVED:
        raise ValueError(f"virtual_chunks={v} needs the interleaved-1f1b schedule, got {schedule.value}")
    if not (math.isfinite(p2p_s) and p2p_s >= 0):
        raise ValueError(f"p2p_s must be finite and >= 0 seconds, got {p2p_s!r}")
    n_virtual = pp * v
    m = len(f[0]) if len(f) else 0
    fa = _durations("f", f, n_virtual, m)
    ba = _durations("b", b, n_virtual, m)
    if w is None:
        if schedule is Schedule.ZB_H1:
            raise ValueError("zb-h1 splits the backward: pass w (backward-weight durations) as well as b")
        wa = np.zeros_like(fa)
    else:
        wa = _durations("w", w, n_virtual, m)
        if schedule is not Schedule.ZB_H1:  # the backward is one op: B carries B + W
            ba = ba + wa
            wa = np.zeros_like(fa)
    if speed is None:
        sp = np.ones(pp)
    else:
        sp = np.asarray(speed, dtype=np.float64)
        if sp.shape != (pp,) or not np.all(np.isfinite(sp)) or np.any(sp <= 0):
            raise ValueError(f"speed: expected {pp} finite factors > 0 (one per device), got {list(speed)}")

    if m == 0:
        zeros = tuple(0.0 for _ in range(pp))
        empty = np.zeros(0)
        return PipelineResult(0.0, zeros, zeros, 0.0, pp, v, 0, empty, empty, (), tuple(() for _ in range(pp)))

    orders = orders_for(schedule, pp, v, m)
    dev_speed = np.tile(sp, v)[:, None]  # virtual stage vs runs on device vs % pp
    dur = np.concatenate([(fa / dev_speed).ravel(), (ba / dev_speed).ravel(), (wa / dev_speed).ravel()]).tolist()
    dep, cross = _graph(n_virtual, pp, m)
    n = len(dur)
    lat = [p2p_s if c else 0.0 for c in cross] if p2p_s > 0 else [0.0] * n

    start = [0.0] * n
    end = [-1.0] * n
    pred = [-1] * n
    pos = [0] * pp
    free = [0.0] * pp
    last = [-1] * pp
    done = 0
    total = sum(len(order) for order in orders)  # no W ops unless zb-h1
    while done < total:
        before = done
        for d in range(pp):
            order = orders[d]
            i = pos[d]
            k = len(order)
            if i == k:
                continue
            t = free[d]
            prev = last[d]
            while i < k:
                op = order[i]
                dd = dep[op]
                p = prev
                if dd >= 0:
                    e = end[dd]
                    if e < 0.0:
                        break
                    e += lat[op]
                    if e > t:
                        t = e
                        p = dd
                start[op] = t
                t += dur[op]
                end[op] = t
                pred[op] = p
                prev = op
                i += 1
            done += i - pos[d]
            pos[d] = i
            free[d] = t
            last[d] = prev
        if done == before:
            raise RuntimeError(f"{schedule.value}: op order deadlocks (pp={pp}, v={v}, m={m}); this is a bug")

    start_a = np.asarray(start)
    end_a = np.asarray(end)
    dur_a = np.asarray(dur).reshape(3, n_virtual, m)
    busy_v = dur_a.sum(axis=(0, 2))  # per virtual stage
    busy = busy_v.reshape(v, pp).sum(axis=0)
    makespan = float(end_a.max())
    idle = makespan - busy
    return PipelineResult(
        makespan_s=makespan,
        busy_s=tuple(float(x) for x in busy),
        idle_s=tuple(float(x) for x in idle),
        bubble_fraction=float(idle.mean() / makespan) if makespan > 0 else 0.0,
        pp=pp,
        virtual_chunks=v,
        microbatches=m,
        _start=start_a,
        _end=end_a,
        _pred=tuple(pred),
        _orders=orders,
    )


# --- a whole iteration ----------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaWork:
    """One data-parallel replica's durations (as for ``simulate_pipeline``)."""

    f: Durations
    b: Durations
    w: Durations | None = None
    pp: int | None = None  # default: len(f) // virtual_chunks
    speed: Sequence[float] | None = None


ReplicaInput = ReplicaWork | tuple[Durations, Durations, Durations | None]


@dataclass(frozen=True)
class IterationResult:
    iteration_s: float  # slowest replica's pipeline + dp sync + optimizer
    replica_s: tuple[float, ...]  # per-replica pipeline makespan
    pipelines: tuple[PipelineResult, ...]
    dp_sync_s: float = 0.0
    optimizer_s: float = 0.0

    @property
    def slowest_replica(self) -> int:
        return int(np.argmax(self.replica_s)) if self.replica_s else -1


def simulate_iteration(
    schedule: Schedule,
    replicas: Sequence[ReplicaInput],
    *,
    dp_sync_s: float = 0.0,
    optimizer_s: float = 0.0,
    p2p_s: float = 0.0,
    virtual_chunks: int = 1,
) -> IterationResult:
    """iteration_s = max_r makespan_r + dp_sync_s + optimizer_s (module docstring)."""
    if not replicas:
        raise ValueError("simulate_iteration: needs at least one data-parallel replica")
    for name, value in (("dp_sync_s", dp_sync_s), ("optimizer_s", optimizer_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    results: list[PipelineResult] = []
    for idx, rep in enumerate(replicas):
        work = rep if isinstance(rep, ReplicaWork) else ReplicaWork(*rep)
        pp = work.pp if work.pp is not None else len(work.f) // virtual_chunks
        if pp < 1 or (work.pp is None and len(work.f) % virtual_chunks):
            raise ValueError(
                f"replica {idx}: {len(work.f)} rows of f do not make whole pipelines of {virtual_chunks} chunk(s)"
            )
        try:
            results.append(
                simulate_pipeline(
                    schedule, work.f, work.b, work.w, pp=pp, virtual_chunks=virtual_chunks,
                    p2p_s=p2p_s, speed=work.speed,
                )
            )
        except ValueError as exc:
            raise ValueError(f"replica {idx}: {exc}") from None
    spans = tuple(r.makespan_s for r in results)
    return IterationResult(
        iteration_s=max(spans) + dp_sync_s + optimizer_s,
        replica_s=spans,
        pipelines=tuple(results),
        dp_sync_s=dp_sync_s,
        optimizer_s=optimizer_s,
    )


# --- closed forms (the planner's fast path; the tests' oracle) --------------------------


def _check_pm(pp: int, m: int) -> None:
    if pp < 1 or m < 1:
        raise ValueError(f"need pp >= 1 and m >= 1 micro-batches, got pp={pp}, m={m}")


def bubble_fraction_1f1b(pp: int, m: int) -> float:
    """(p-1)/m: bubble time over ideal compute time."""
    _check_pm(pp, m)
    return (pp - 1) / m


def bubble_fraction_interleaved(pp: int, v: int, m: int) -> float:
    """(p-1)/(v·m): bubble over ideal compute, v chunks per device."""
    _check_pm(pp, m)
    if v < 1:
        raise ValueError(f"need v >= 1 chunks per device, got {v}")
    return (pp - 1) / (v * m)


def bubble_fraction_zb_h1(pp: int, m: int) -> float:
    """(p-1)/(3m): bubble over ideal compute with T_F = T_B = T_W."""
    _check_pm(pp, m)
    return (pp - 1) / (3 * m)


def one_f_one_b_time(stage_f: Sequence[float], stage_b: Sequence[float], m: int, p2p_s: float = 0.0) -> float:
    """Oobleck's closed form for 1F1B with unequal stages:
    Σ_i (f_i + b_i) + (m-1)·max_i (f_i + b_i) + 2·(p-1)·p2p_s.
    The first micro-batch's full round trip plus m-1 periods of the bottleneck stage. It
    is exact when the bottleneck is the last stage (or all stages are equal) and an upper
    bound otherwise (a bottleneck earlier in the pipe hides the round trip of the stages
    before it)."""
    if len(stage_f) != len(stage_b) or not stage_f:
        raise ValueError(
            f"stage_f and stage_b need one entry per stage, got {len(stage_f)} and {len(stage_b)}"
        )
    if m < 1:
        raise ValueError(f"need m >= 1 micro-batches, got {m}")
    per = [float(x) + float(y) for x, y in zip(stage_f, stage_b)]
    if not all(math.isfinite(x) and x >= 0 for x in [*stage_f, *stage_b, p2p_s]):
        raise ValueError("stage times and p2p_s must be finite and >= 0 seconds")
    return sum(per) + (m - 1) * max(per) + 2 * (len(per) - 1) * p2p_s
