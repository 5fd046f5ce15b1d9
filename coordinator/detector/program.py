"""A pipeline schedule compiled once, evaluated for many replicas at once with numpy.

The schedule simulator (``resihp.coordinator.schedule.simulator`` with its per-device op orders in
``schedule.orders``) decides the order in which each device runs its F / B / W ops; that order is a property of the schedule, the pipeline depth,
the number of virtual chunks and of micro-batches — not of the durations. We take it from one
simulator run and turn it into a straight-line program (ops in a topological order with the
index of their same-device predecessor and of their cross-stage dependency). Evaluating that
program is a loop over ops whose body is a couple of ``numpy.maximum`` calls over a batch
axis, so predicting 64 replicas costs about what predicting one does. The detector uses it
for the predicted iteration time; the workload generator uses it to place ground-truth ops.

Pure (numpy only), deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from resihp.coordinator.model.plan import Schedule

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

KIND_INDEX = {"F": 0, "B": 1, "W": 2}


@dataclass(frozen=True)
class ScheduleProgram:
    """Straight-line form of one pipeline's schedule.

    Op ``i`` runs on device ``device[i]``, is of kind ``kind[i]`` (0=F, 1=B, 2=W) for
    micro-batch ``microbatch[i]`` of virtual stage ``vstage[i]`` (chunk ``vstage // pp``).
    ``prev[i]`` is the op that runs just before it on the same device (-1: none) and
    ``dep[i]`` the op whose output it needs (-1: none); ``hop[i]`` says whether that
    dependency crosses devices (then a P2P transfer sits between them). Ops are listed in a
    topological order, so one forward pass evaluates the schedule.
    """

    schedule: Schedule
    pp: int
    virtual_chunks: int
    microbatches: int
    device: tuple[int, ...]
    kind: tuple[int, ...]
    microbatch: tuple[int, ...]
    vstage: tuple[int, ...]
    prev: tuple[int, ...]
    dep: tuple[int, ...]
    hop: tuple[bool, ...]

    @property
    def num_ops(self) -> int:
        return len(self.device)

    @property
    def split_backward(self) -> bool:
        return self.schedule is Schedule.ZB_H1

    def evaluate(
        self,
        dur: FloatArray,
        hop_s: FloatArray | float = 0.0,
        delay: FloatArray | None = None,
    ) -> tuple[FloatArray, FloatArray]:
        """Start and end time of every op, for a batch of pipelines.

        dur: [batch, num_ops] durations; hop_s: P2P time of the transfer into each op
        ([batch, num_ops], or a scalar); delay: extra wait before an op may start (pauses).
        Returns (start, end), each [batch, num_ops], from the pipeline's time 0.
        """
        # op-major layout: each op's row is contiguous, which the loop below touches
        d_t = np.ascontiguousarray(dur.T)
        h_t = np.ascontiguousarray(np.broadcast_to(np.asarray(hop_s, dtype=np.float64), dur.shape).T)
        w_t = None if delay is None else np.ascontiguousarray(delay.T)
        start = np.empty_like(d_t)
        end = np.empty_like(d_t)
        zero = np.zeros(dur.shape[0])
        prev, dep, hop = self.prev, self.dep, self.hop
        for i in range(self.num_ops):
            p, d = prev[i], dep[i]
            t = end[p] if p >= 0 else zero
            if d >= 0:
                t = np.maximum(t, end[d] + h_t[i] if hop[i] else end[d])
            if w_t is not None:
                t = t + w_t[i]
            start[i] = t
            np.add(t, d_t[i], out=end[i])
        return start.T, end.T


def _dependency(kind: str, j: int, m: int, n_virtual: int, split: bool) -> tuple[str, int, int] | None:
    if kind == "F":
        return ("F", j - 1, m) if j > 0 else None
    if kind == "B":
        return ("B", j + 1, m) if j < n_virtual - 1 else ("F", j, m)
    return ("B", j, m)  # W needs its own B


def compile_from_orders(
    schedule: Schedule, pp: int, virtual_chunks: int, microbatches: int,
    orders: list[list[tuple[str, int, int]]],
) -> ScheduleProgram:
    """Build the program from each device's op order: orders[device] = [(kind, chunk, mb)]."""
    n_virtual = pp * virtual_chunks
    split = schedule is Schedule.ZB_H1
    ops: list[tuple[int, str, int, int]] = []  # (device, kind, vstage, mb)
    index: dict[tuple[str, int, int], int] = {}
    for dev, order in enumerate(orders):
        for kind, chunk, mb in order:
            j = chunk * pp + dev
            index[(kind, j, mb)] = len(ops)
            ops.append((dev, kind, j, mb))
    # same-device predecessor and cross-stage dependency, by the unsorted index
    prev_u = [-1] * len(ops)
    for dev, order in enumerate(orders):
        last = -1
        for kind, chunk, mb in order:
            i = index[(kind, chunk * pp + dev, mb)]
            prev_u[i] = last
            last = i
    dep_u = [-1] * len(ops)
    for i, (_dev, kind, j, mb) in enumerate(ops):
        need = _dependency(kind, j, mb, n_virtual, split)
        if need is not None:
            if need not in index:
                raise ValueError(f"schedule has {kind}{j}/{mb} but not the op it needs, {need}")
            dep_u[i] = index[need]
    # Kahn's algorithm: a topological order over both kinds of edge
    indeg = [0] * len(ops)
    children: list[list[int]] = [[] for _ in ops]
    for i in range(len(ops)):
        for p in (prev_u[i], dep_u[i]):
            if p >= 0:
                indeg[i] += 1
                children[p].append(i)
    ready = [i for i in range(len(ops)) if indeg[i] == 0]
    topo: list[int] = []
    while ready:
        i = ready.pop()
        topo.append(i)
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(topo) != len(ops):
        raise ValueError("schedule order has a cycle (a device waits for an op that waits for it)")
    pos = {u: k for k, u in enumerate(topo)}
    return ScheduleProgram(
        schedule=schedule, pp=pp, virtual_chunks=virtual_chunks, microbatches=microbatches,
        device=tuple(ops[u][0] for u in topo),
        kind=tuple(KIND_INDEX[ops[u][1]] for u in topo),
        microbatch=tuple(ops[u][3] for u in topo),
        vstage=tuple(ops[u][2] for u in topo),
        prev=tuple(pos[prev_u[u]] if prev_u[u] >= 0 else -1 for u in topo),
        dep=tuple(pos[dep_u[u]] if dep_u[u] >= 0 else -1 for u in topo),
        hop=tuple(dep_u[u] >= 0 and ops[dep_u[u]][0] != ops[u][0] for u in topo),
    )


@lru_cache(maxsize=64)
def compile_schedule(schedule: Schedule, pp: int, virtual_chunks: int, microbatches: int) -> ScheduleProgram:
    """Compile from the schedule simulator's per-device op orders (``schedule.orders``)."""
    from resihp.coordinator.schedule.orders import orders_for

    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got {microbatches}")
    n_virtual = pp * virtual_chunks
    names = ("F", "B", "W")
    orders: list[list[tuple[str, int, int]]] = []
    for dev_order in orders_for(schedule, pp, virtual_chunks, microbatches):
        seq = []
        for op in dev_order:
            kind, rest = divmod(op, n_virtual * microbatches)
            vstage, mb = divmod(rest, microbatches)
            seq.append((names[kind], vstage // pp, mb))
        orders.append(seq)
    return compile_from_orders(schedule, pp, virtual_chunks, microbatches, orders)


def program_arrays(prog: ScheduleProgram) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """(device, kind, microbatch, vstage) as arrays, for vectorised gathers."""
    return (
        np.asarray(prog.device, dtype=np.int64), np.asarray(prog.kind, dtype=np.int64),
        np.asarray(prog.microbatch, dtype=np.int64), np.asarray(prog.vstage, dtype=np.int64),
    )
