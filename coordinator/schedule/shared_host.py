"""One iteration of every replica's pipeline on devices that share a host's compute.

``schedule.simulate_iteration`` gives every pipeline stage a device of its own, which runs
one op at a time at a fixed speed. Where several ranks share one host's compute — CPU ranks
on fewer cores than ranks, or ranks sharing one GPU — a rank computes faster while its
neighbours wait than while they compute too. Here every rank of a host runs at
``host_speed[k - 1]`` of its solo speed while ``k`` of the host's ranks compute (processor
sharing), so the bubbles of a pipeline, an unequal data-parallel split or a stage that waits
for its peer run at full speed and the overlapped parts slower.

Same dependency rules as ``schedule.simulate_pipeline`` (ops of a stage in the schedule's
order; F waits for the previous stage's F + ``p2p_s``, B for the next stage's B + ``p2p_s``),
simulated jointly over all replicas with rate changes at every start and end. Durations
are solo durations (the rank alone on its host). A (replica, stage) of a TP group of ``t``
ranks counts as ``t`` busy ranks. Pure and deterministic; numpy-free; no torch.

    iteration_s = last op end over all replicas + dp_sync_s + optimizer_s
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.schedule.orders import orders_for
from resihp.coordinator.schedule.simulator import Durations, _durations, _graph

EPS = 1e-12


@dataclass(frozen=True)
class SharedResult:
    iteration_s: float
    makespan_s: float  # last op end, over all replicas
    # per replica, per op id (schedule's encoding): start and end times
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    microbatches: tuple[int, ...]

    def op_span(self, replica: int, kind: int, stage: int, microbatch: int, pp: int) -> tuple[float, float]:
        m = self.microbatches[replica]
        op = (kind * pp + stage) * m + microbatch
        return self.starts[replica][op], self.ends[replica][op]


def speed_for(host_speed: Sequence[float], busy: int) -> float:
    """Speed of one busy rank while ``busy`` ranks of its host compute; past the measured list
    the host's total throughput stays at its last measured value (shared equally)."""
    if busy <= len(host_speed):
        return host_speed[busy - 1]
    n = len(host_speed)
    return host_speed[-1] * n / busy


def simulate_shared(
    schedule: Schedule,
    f: Sequence[Durations],
    b: Sequence[Durations],
    *,
    host_of: Sequence[Sequence[int]],
    width: Sequence[Sequence[int]] | None = None,
    host_speed: Sequence[float] = (1.0,),
    p2p_s: float = 0.0,
    dp_sync_s: float = 0.0,
    optimizer_s: float = 0.0,
) -> SharedResult:
    """``f[r][s][i]``, ``b[r][s][i]``: solo durations of replica r, stage s, micro-batch i;
    ``host_of[r][s]``: the host of that stage's ranks; ``width[r][s]``: how many ranks it has
    (default 1); ``host_speed[k - 1]``: a rank's speed while k ranks of its host compute
    (``[1.0]`` = every rank its own device). 1F1B only."""
    schedule = Schedule(schedule)
    if schedule is not Schedule.ONE_F_ONE_B:
        raise ValueError(f"simulate_shared: only 1f1b is modelled, got {schedule.value}")
    if not f or len(f) != len(b) or len(host_of) != len(f):
        raise ValueError("simulate_shared: f, b and host_of need one entry per replica")
    speeds = [float(s) for s in host_speed]
    if not speeds or any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"host_speed: expected finite speeds > 0, got {list(host_speed)}")
    for name, value in (("p2p_s", p2p_s), ("dp_sync_s", dp_sync_s), ("optimizer_s", optimizer_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0 seconds, got {value!r}")

    # devices: (replica, stage); per device its op order, durations and dependencies
    devices: list[tuple[int, int]] = []
    orders: list[tuple[int, ...]] = []
    durs: list[list[float]] = []
    deps: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []
    ms: list[int] = []
    for r in range(len(f)):
        pp = len(f[r])
        if len(host_of[r]) != pp or (width is not None and len(width[r]) != pp):
            raise ValueError(f"replica {r}: host_of (and width) need one entry per stage ({pp})")
        m = len(f[r][0]) if pp else 0
        fa, ba = _durations("f", f[r], pp, m), _durations("b", b[r], pp, m)
        ms.append(m)
        dur = [*fa.ravel().tolist(), *ba.ravel().tolist(), *([0.0] * (pp * m))]
        durs.append(dur)
        deps.append(_graph(pp, pp, m))
        per_stage = orders_for(schedule, pp, 1, m) if m else tuple(() for _ in range(pp))
        for s in range(pp):
            devices.append((r, s))
            orders.append(per_stage[s])

    n_dev = len(devices)
    host = [host_of[r][s] for r, s in devices]
    wide = [width[r][s] if width is not None else 1 for r, s in devices]
    starts = [[0.0] * len(d) for d in durs]
    ends = [[-1.0] * len(d) for d in durs]
    pos = [0] * n_dev
    running: list[int] = [-1] * n_dev  # op id or -1
    left = [0.0] * n_dev  # solo seconds of work left of the running op
    total = sum(len(o) for o in orders)
    done = 0
    t = 0.0
    while done < total:
        # start every op whose device is free and whose input has arrived
        wake = math.inf
        for d in range(n_dev):
            if running[d] >= 0 or pos[d] == len(orders[d]):
                continue
            r = devices[d][0]
            op = orders[d][pos[d]]
            dep, cross = deps[r][0][op], deps[r][1][op]
            ready = 0.0
            if dep >= 0:
                e = ends[r][dep]
                if e < 0.0:
                    continue
                ready = e + (p2p_s if cross else 0.0)
            if ready > t + EPS:
                wake = min(wake, ready)
                continue
            running[d], left[d] = op, durs[r][op]
            starts[r][op] = t
        busy: dict[int, int] = {}
        for d in range(n_dev):
            if running[d] >= 0:
                busy[host[d]] = busy.get(host[d], 0) + wide[d]
        rate = [speed_for(speeds, busy[host[d]]) if running[d] >= 0 else 0.0 for d in range(n_dev)]
        step = min([left[d] / rate[d] for d in range(n_dev) if running[d] >= 0] + [wake - t])
        if not math.isfinite(step):
            raise RuntimeError("simulate_shared: no op can start; the op order deadlocks (a bug)")
        t += step
        for d in range(n_dev):
            if running[d] < 0:
                continue
            left[d] -= rate[d] * step
            if left[d] <= EPS * max(1.0, durs[devices[d][0]][running[d]]):
                r = devices[d][0]
                ends[r][running[d]] = t
                running[d] = -1
                pos[d] += 1
                done += 1
    makespan = max((max(e) for e in ends if e), default=0.0)
    makespan = max(makespan, 0.0)
    return SharedResult(
        iteration_s=makespan + dp_sync_s + optimizer_s, makespan_s=makespan,
        starts=tuple(tuple(s) for s in starts), ends=tuple(tuple(e) for e in ends), microbatches=tuple(ms),
    )
