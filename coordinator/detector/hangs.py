"""Who holds up a job that makes no progress (docs/detector.md, "Hangs"): from how long each
rank has been silent, or, where every rank beats on, from the ops the heartbeats name — the
rank that waits for nobody while its peers wait for it. Pure: the detector and the
coordinator's own liveness clock both use it."""
from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from resihp.coordinator.model.trace import OpState


def hang_culprits(stalled_s: float, wait_s: float, silence_s: Mapping[int, float],
                  op_held_s: Mapping[int, float] | None = None) -> list[int]:
    """The ranks that hold up a job with no iteration for ``stalled_s`` (a hang once it
    exceeds ``wait_s``), from how long each live rank has been silent: silent for more than
    max(1 s, half the wait) beyond the ranks' usual silence (their median: most beat on) and
    for at least half the stall. None when the job is not stalled, when fewer than two ranks
    are heard, or when as many as half are silent (that is not one rank holding the rest).
    ``op_held_s`` (as in ``stuck_culprits``): none either while a rank that beats on still
    enters new ops — the job is slow, not stopped (a rank many times slower makes iterations
    outlast the wait, and a healthy rank's heartbeat thread, starved 1.7 s on a loaded host
    meanwhile, was taken for a stopped process).
    Pure: the detector and the coordinator's own liveness clock both use it."""
    if stalled_s <= wait_s or len(silence_s) < 2:
        return []
    usual = float(np.median(list(silence_s.values())))
    margin = max(1.0, 0.5 * wait_s)
    held = sorted(r for r, q in silence_s.items() if q > usual + margin and q >= 0.5 * stalled_s)
    if op_held_s is not None and moving(op_held_s, wait_s, exclude=held):
        return []
    return held if 2 * len(held) < len(silence_s) else []


def moving(op_held_s: Mapping[int, float], wait_s: float, exclude: Collection[int] = ()) -> bool:
    """Whether some rank (not in ``exclude``) has held the op it is in for less than
    ``HELD_SHARE`` of the hang wait, by its beats: it still moves from op to op."""
    return any(h < HELD_SHARE * wait_s for r, h in op_held_s.items() if r not in exclude)


STATE_SETTLE_S = 1.0  # an op state counts once reported this long after the last progress (a beat)
# a rank still moving from op to op: it entered the op it is in less than a quarter of the hang
# wait ago (a rank slowed even 10x enters ops far more often: a micro-batch's F or B is a few
# per cent of an iteration)
HELD_SHARE = 0.25
# a rank stuck in an op holds it for good: named once it has held one op (from the first to the
# latest beat that named it) for half the hang wait, and for at least STUCK_HELD_MIN_S. Half: a
# stuck rank entered its op after the job's last iteration, so it has held it for most of the
# wait when the job is found stopped (found within 2 predicted iterations + 1 s). The minimum:
# at the wait's 2 s floor (short iterations), a rank throttled 80x on 2 loaded cores held one
# compute op across two beats a second apart, and a no-progress verdict killed a rank that was
# only slow (CI, stop 45); three beats naming one op are needed there
STUCK_HELD_SHARE = 0.5
STUCK_HELD_MIN_S = 2.0


def stuck_held_s(wait_s: float) -> float:
    """How long a rank must have held one op to be named stuck, for a hang wait of ``wait_s``."""
    return max(STUCK_HELD_SHARE * wait_s, STUCK_HELD_MIN_S)


def stuck_culprits(stalled_s: float, wait_s: float, ops: Mapping[int, OpState | None],
                   op_age_s: Mapping[int, float], op_held_s: Mapping[int, float] | None = None) -> list[int]:
    """The ranks that hold up a job with no iteration for ``stalled_s`` while every rank beats
    on (a kernel or a collective that never returns, a rank stuck in its data loader): those
    that wait for nobody — inside a compute op, or between ops — while the others wait inside
    a p2p or collective op that needs them. The idea of torch's NCCL flight recorder, from the
    last op each rank reported entering and completing. Only op states reported at least
    ``STATE_SETTLE_S`` after the job stopped count (``op_age_s``: seconds since each was
    reported); none unless every live rank has one, some wait, and fewer than half do not.
    ``op_held_s``: seconds from the first to the latest beat of each rank that named the op it
    is in (its ``seq``: beats are all we know of it, so a rank that moved on since its latest
    beat is not taken as still in it); a culprit must have held it for ``stuck_held_s(wait_s)``:
    a rank many times slower than usual (a severe fail-slow) still enters op after op, and its
    peers wait for it meanwhile — it is slow, not stuck, and a no-progress verdict would kill it.
    Pure: the detector and the coordinator's liveness both use it."""
    if stalled_s <= wait_s or len(ops) < 3:
        return []
    fresh = stalled_s - STATE_SETTLE_S
    if any(o is None or op_age_s.get(r, float("inf")) > fresh for r, o in ops.items()):
        return []
    free = sorted(r for r, o in ops.items() if o is not None and not o.waiting)
    if not free or 2 * len(free) >= len(ops):
        return []
    if op_held_s is not None and any(op_held_s.get(r, 0.0) < stuck_held_s(wait_s) for r in free):
        return []  # one of them has not held its op long enough: slow, not stuck (yet)
    return free


def stuck_reason(rank: int, ops: Mapping[int, OpState | None], stalled_s: float, wait_s: float) -> str:
    """Why ``rank`` (one ``stuck_culprits`` named) holds the job up, for a finding's reason:
    the op it is in and the ranks that wait for it (the first eight)."""
    op = ops[rank]
    waiting = sorted(r for r, o in ops.items() if o is not None and o.waiting)
    shown = ", ".join(map(str, waiting[:8])) + (f" and {len(waiting) - 8} more" if len(waiting) > 8 else "")
    return (f"no iteration for {stalled_s:.1f} s (hang after {wait_s:.1f} s) while every rank beats on; rank {rank} "
            f"is {op.describe() if op is not None else 'in no op'} and waits for nobody, while ranks {shown} wait in "
            f"p2p or collective ops: a stuck kernel, collective or data loader on rank {rank} holds the job up")


__all__ = ["HELD_SHARE", "STATE_SETTLE_S", "STUCK_HELD_MIN_S", "STUCK_HELD_SHARE", "hang_culprits", "moving",
           "stuck_culprits", "stuck_held_s", "stuck_reason"]
