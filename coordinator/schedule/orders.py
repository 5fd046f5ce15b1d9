"""Per-device op orders of the pipeline schedules, as flat integer op ids.

Op id encoding (shared with ``schedule``): ``((kind * V) + vstage) * m + microbatch`` with
kind 0 = F, 1 = B, 2 = W and V = pp · virtual_chunks virtual stages; virtual stage
``vs`` runs on device ``vs % pp`` as chunk ``vs // pp`` (Megatron's interleaved assignment).

Orders are pure functions of (schedule, pp, v, m), so they are cached.
"""
from __future__ import annotations

from functools import lru_cache

from resihp.coordinator.model.plan import Schedule

F, B, W = 0, 1, 2
Orders = tuple[tuple[int, ...], ...]


def op_id(kind: int, vstage: int, mb: int, n_virtual: int, m: int) -> int:
    return (kind * n_virtual + vstage) * m + mb


def one_f_one_b_fb(stage: int, pp: int, m: int) -> list[tuple[int, int]]:
    """(kind, microbatch) of PipeDream-flush 1F1B on ``stage``: p-s-1 warm-up forwards,
    steady one-forward-one-backward, cool-down backwards."""
    warmup = min(pp - stage - 1, m)
    seq: list[tuple[int, int]] = [(F, i) for i in range(warmup)]
    for i in range(m - warmup):
        seq.append((F, warmup + i))
        seq.append((B, i))
    seq.extend((B, i) for i in range(m - warmup, m))
    return seq


@lru_cache(maxsize=256)
def orders_1f1b(pp: int, m: int) -> Orders:
    return tuple(
        tuple(op_id(k, s, mb, pp, m) for k, mb in one_f_one_b_fb(s, pp, m)) for s in range(pp)
    )


@lru_cache(maxsize=256)
def orders_interleaved(pp: int, v: int, m: int) -> Orders:
    """Megatron's interleaved 1F1B. The k-th forward of a device runs chunk (k // pp) % v on
    micro-batch (k // (pp·v))·pp + k % pp; backwards walk the chunks in reverse. Warm-up is
    (pp - s - 1)·2 + (v - 1)·pp forwards (all of them when m == pp)."""
    if m % pp:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp}); "
            f"use {((m // pp) + 1) * pp} or {max(pp, (m // pp) * pp)} micro-batches, or the 1f1b schedule"
        )
    n_virtual = pp * v
    total = m * v

    def fwd(s: int, k: int) -> int:
        chunk = (k // pp) % v
        return op_id(F, chunk * pp + s, (k // (pp * v)) * pp + k % pp, n_virtual, m)

    def bwd(s: int, k: int) -> int:
        chunk = v - 1 - (k // pp) % v
        return op_id(B, chunk * pp + s, (k // (pp * v)) * pp + k % pp, n_virtual, m)

    out: list[tuple[int, ...]] = []
    for s in range(pp):
        warmup = total if m == pp else min((pp - s - 1) * 2 + (v - 1) * pp, total)
        seq = [fwd(s, k) for k in range(warmup)]
        for k in range(total - warmup):
            seq.append(fwd(s, warmup + k))
            seq.append(bwd(s, k))
        seq.extend(bwd(s, k) for k in range(total - warmup, total))
        out.append(tuple(seq))
    return tuple(out)


@lru_cache(maxsize=256)
def orders_zb_h1(pp: int, m: int) -> Orders:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the F/B order of 1F1B (so at
    most pp - s forwards await their B: 1F1B's peak activation memory), with every W
    deferred to the first moment its device would otherwise idle, and the rest at the end.

    The order is fixed by one list-scheduling pass at unit F = B = W durations, where the
    paper's handcrafted schedule reaches its (p-1)·(T_F + T_B - T_W) bubble; real
    durations then run this fixed order."""
    fb = [one_f_one_b_fb(s, pp, m) for s in range(pp)]
    # unit-time end of F/B of (stage, mb); -1 = not done
    f_end = [[-1] * m for _ in range(pp)]
    b_end = [[-1] * m for _ in range(pp)]
    pos = [0] * pp
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    out: list[list[int]] = [[] for _ in range(pp)]
    remaining = 3 * pp * m
    t = 0
    while remaining:
        for s in range(pp):
            seq = fb[s]
            ready = False
            if pos[s] < len(seq):
                kind, mb = seq[pos[s]]
                if kind == F:
                    ready = s == 0 or 0 <= f_end[s - 1][mb] <= t
                else:
                    dep = f_end[s][mb] if s == pp - 1 else b_end[s + 1][mb]
                    ready = 0 <= dep <= t
            if ready:
                kind, mb = seq[pos[s]]
                pos[s] += 1
                if kind == F:
                    f_end[s][mb] = t + 1
                else:
                    b_end[s][mb] = t + 1
                    pending_w[s].append(mb)
                out[s].append(op_id(kind, s, mb, pp, m))
            elif pending_w[s]:
                mb_w = pending_w[s].pop(0)
                out[s].append(op_id(W, s, mb_w, pp, m))
            else:
                continue
            remaining -= 1
        t += 1
    return tuple(tuple(o) for o in out)


def orders_for(schedule: Schedule, pp: int, v: int, m: int) -> Orders:
    if schedule is Schedule.ONE_F_ONE_B:
        return orders_1f1b(pp, m)
    if schedule is Schedule.INTERLEAVED:
        return orders_interleaved(pp, v, m)
    if schedule is Schedule.ZB_H1:
        return orders_zb_h1(pp, m)
    raise ValueError(f"unknown schedule {schedule!r}")
