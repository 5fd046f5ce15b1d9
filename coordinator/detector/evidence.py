"""The detector's view of an iteration: dense per-rank arrays instead of chunk records.

A trace (or the coordinator's aggregator) delivers chunk timings as a list of records; the
detector works on ``IterationTimings``, where every per-rank quantity is a numpy array
indexed by the rank's position in ``PlanIndex.ranks``. Converting is O(chunks) Python and
happens once per iteration; everything after it is vectorised over ranks.

Pure (numpy only).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from itertools import chain

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.program import ScheduleProgram, compile_schedule, program_arrays
from resihp.coordinator.model.plan import Plan, Schedule
from resihp.coordinator.model.trace import IterationRecord

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
KINDS = ("F", "B", "W")
FWD, BWD = 0, 1  # direction of an inbound P2P transfer: activation into F, gradient into B


@dataclass
class IterationTimings:
    """One iteration, dense. NaN marks an op or transfer that did not happen / was not timed.

    compute[n, v, k, m]: rank n's own busy time of kind k (F, B, W) of chunk v, micro-batch m.
    p2p[n, v, d, m]: the inbound transfer before that F (d=0) or B (d=1) on rank n.
    dp[n], opt[n]: gradient all-reduce and optimizer step; rank_step[n]: whole-step busy time.
    dp_start[n]: when rank n entered the all-reduce; dp_wait[n]: how long of its span it
    waited for the ring's last member (``split_dp_wait`` sets it and leaves dp the transfer).
    tp_wait[n]: seconds rank n's compute spans spent inside TP collectives (its ``TP``
    chunks); None when no rank recorded any.
    """

    iteration: int
    start_s: float
    time_s: float
    seqlens: tuple[tuple[tuple[int, ...], ...], ...]
    compute: FloatArray | None = None
    p2p: FloatArray | None = None
    dp: FloatArray | None = None
    opt: FloatArray | None = None
    rank_step: FloatArray | None = None
    tp_wait: FloatArray | None = None
    # when each rank entered its DP all-reduce (from the iteration's start); with it the span's
    # wait for the ring's last arriver is told from the transfer (``split_dp_wait``)
    dp_start: FloatArray | None = None
    dp_wait: FloatArray | None = None


class PlanIndex:
    """Everything about a plan the detector needs per iteration, precomputed as arrays."""

    def __init__(self, plan: Plan, nodes: Mapping[int, str] | None = None,
                 tags: Mapping[int, Hashable] | None = None) -> None:
        """``tags``: rank -> a calibration tag appended to every cost key of that rank. The
        detector tags ranks whose work changed with a plan change, so their keys are fresh
        and re-learn, while the keys of untagged (unchanged) ranks keep their calibration."""
        self.plan = plan
        tag_of = dict(tags or {})
        node_of = dict(nodes or {})
        self.ranks: tuple[int, ...] = plan.ranks()
        self.pos: dict[int, int] = {r: i for i, r in enumerate(self.ranks)}
        n = len(self.ranks)
        self.n = n
        self.V = plan.virtual_chunks
        self.M = max(1, max(rep.microbatches for rep in plan.replicas))
        self.split_backward = plan.schedule is Schedule.ZB_H1
        positions = [plan.position(r) for r in self.ranks]
        self.rep = np.array([p.replica for p in positions], dtype=np.int64)
        self.stage = np.array([p.stage for p in positions], dtype=np.int64)
        self.tp_idx = np.array([p.tp_index for p in positions], dtype=np.int64)
        self.tp_size = np.array([p.tp_size for p in positions], dtype=np.int64)
        self.pp_of_rep = np.array([rep.pp for rep in plan.replicas], dtype=np.int64)
        # the rank that receives r's activations (forward) and r's gradients (backward)
        self.fwd_recv = np.full(n, -1, dtype=np.int64)
        self.bwd_recv = np.full(n, -1, dtype=np.int64)
        for i, p in enumerate(positions):
            rep = plan.replicas[p.replica]
            pp = rep.pp
            if pp == 1:
                continue
            nxt, prv = (p.stage + 1) % pp, (p.stage - 1) % pp
            has_next = p.stage < pp - 1 or self.V > 1
            has_prev = p.stage > 0 or self.V > 1
            if has_next:
                g = rep.stages[nxt]
                self.fwd_recv[i] = self.pos[g[p.tp_index % len(g)]]
            if has_prev:
                g = rep.stages[prv]
                self.bwd_recv[i] = self.pos[g[p.tp_index % len(g)]]
        # whether the pipeline neighbour that receives our activations / gradients sits on
        # another node (only those transfers use the rank's NIC)
        node_arr = [node_of.get(r) for r in self.ranks]
        # a dense id per node (-1: not known), for evidence shared by the ranks of one host
        dense: dict[str, int] = {}
        self.node_id = np.array([-1 if x is None else dense.setdefault(x, len(dense)) for x in node_arr],
                                dtype=np.int64)
        # the positions of each host's ranks as rows, -1 padded: per-host medians in one sort
        members: list[list[int]] = [[] for _ in dense]
        for i, h in enumerate(self.node_id.tolist()):
            if h >= 0:
                members[h].append(i)
        width = max((len(x) for x in members), default=0)
        self.host_rows = np.array([x + [-1] * (width - len(x)) for x in members], dtype=np.int64).reshape(
            len(members), width)
        self.cross_fwd = np.array([f >= 0 and node_arr[int(f)] != node_arr[i] for i, f in enumerate(self.fwd_recv)])
        self.cross_bwd = np.array([b >= 0 and node_arr[int(b)] != node_arr[i] for i, b in enumerate(self.bwd_recv)])
        # cost-model keys: what a duration depends on besides the batch
        self.keys: list[tuple[object, ...]] = []
        key_id: dict[tuple[object, ...], int] = {}

        def kid(key: tuple[object, ...]) -> int:
            if key not in key_id:
                key_id[key] = len(self.keys)
                self.keys.append(key)
            return key_id[key]

        self.ckey = np.full((n, self.V, 3), -1, dtype=np.int64)
        self.pkey = np.full((n, self.V, 2), -1, dtype=np.int64)
        self.dkey = np.zeros(n, dtype=np.int64)
        self.okey = np.zeros(n, dtype=np.int64)
        ranges = [rep.layer_ranges() for rep in plan.replicas]
        for i, p in enumerate(positions):
            tag = tag_of.get(self.ranks[i])
            own: tuple[object, ...] = () if tag is None else (tag,)
            rep = plan.replicas[p.replica]
            n_virtual = rep.pp * self.V
            for v in range(self.V):
                j = v * rep.pp + p.stage
                lo, hi = ranges[p.replica][j]
                where = ("first" if j == 0 else "") + ("last" if j == n_virtual - 1 else "")
                for k in range(3):
                    if k == 2 and not self.split_backward:
                        continue
                    self.ckey[i, v, k] = kid(("compute", KINDS[k], lo, hi, where, p.tp_size) + own)
                me = node_of.get(self.ranks[i])
                # an activation comes from the rank we send gradients to, and vice versa
                if j > 0:
                    src = self.ranks[int(self.bwd_recv[i])]
                    self.pkey[i, v, FWD] = kid(("p2p", "F", lo, p.tp_size, node_of.get(src) != me) + own)
                if j < n_virtual - 1:
                    src = self.ranks[int(self.fwd_recv[i])]
                    self.pkey[i, v, BWD] = kid(("p2p", "B", hi, p.tp_size, node_of.get(src) != me) + own)
            mine = tuple(ranges[p.replica][v * rep.pp + p.stage] for v in range(self.V))
            self.dkey[i] = kid(("dp", mine, p.tp_size, plan.dp) + own)
            self.okey[i] = kid(("opt", mine, p.tp_size) + own)
        self.n_keys = len(self.keys)
        # one compiled schedule per replica; replicas that share one are evaluated together
        self.programs: dict[tuple[int, int], ScheduleProgram] = {}
        self.rep_program: list[tuple[int, int]] = []
        for rep in plan.replicas:
            shape = (rep.pp, rep.microbatches)
            if rep.microbatches > 0 and shape not in self.programs:
                self.programs[shape] = compile_schedule(plan.schedule, rep.pp, self.V, rep.microbatches)
            self.rep_program.append(shape)
        # leader rank (TP index 0) of every (replica, stage): the TP group's representative
        self.group_of = np.zeros(n, dtype=np.int64)  # dense (replica, stage) group id
        groups: dict[tuple[int, int], int] = {}
        for i, p in enumerate(positions):
            self.group_of[i] = groups.setdefault((p.replica, p.stage), len(groups))
        self.n_groups = len(groups)
        # DP rings: the ranks of one (stage, TP index) across replicas all-reduce together
        rings: dict[tuple[int, int], int] = {}
        self.ring = np.array([rings.setdefault((p.stage, p.tp_index), len(rings)) for p in positions],
                             dtype=np.int64)
        self.n_rings = max(1, len(rings))
        # the positions of each ring's members as rows, -1 padded (per-ring maxima without ufunc.at)
        ring_members: list[list[int]] = [[] for _ in range(self.n_rings)]
        for i, ring in enumerate(self.ring.tolist()):
            ring_members[ring].append(i)
        width = max((len(x) for x in ring_members), default=0)
        self.ring_rows = np.array([x + [-1] * (width - len(x)) for x in ring_members], dtype=np.int64).reshape(
            self.n_rings, width)
        self.group_key = list(groups)
        self.group_leader = np.zeros(self.n_groups, dtype=np.int64)
        for (r_idx, s_idx), g_id in groups.items():
            self.group_leader[g_id] = self.pos[plan.replicas[r_idx].stages[s_idx][0]]

    def program_gather(self, shape: tuple[int, int]) -> tuple[ScheduleProgram, IntArray, IntArray, IntArray, IntArray]:
        prog = self.programs[shape]
        dev, kind, mb, vstage = program_arrays(prog)
        return prog, dev, kind, mb, vstage


def rank_work(plan: Plan) -> dict[int, tuple[str, int, int, int, int, tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """rank -> what its cost keys measure beyond the batch: schedule, chunks per device,
    pipeline depth, stage, micro-batch share (index 4), its chunks' layer ranges and its
    TP group. A rank whose tuple changes with a plan change re-warms its keys."""
    out = {}
    v = plan.virtual_chunks
    for rep in plan.replicas:
        ranges = rep.layer_ranges()
        for s, group in enumerate(rep.stages):
            work = (plan.schedule.value, v, rep.pp, s, rep.microbatches,
                    tuple(ranges[k * rep.pp + s] for k in range(v)), group)
            for r in group:
                out[r] = work
    return out


def timings_from_record(rec: IterationRecord, index: PlanIndex) -> IterationTimings:
    """Dense arrays from a trace record (chunks and/or rank_step_s)."""
    n, V, M = index.n, index.V, index.M
    out = IterationTimings(rec.iteration, rec.start_s, rec.time_s, rec.seqlens)
    if rec.chunks:
        compute = np.full((n, V, 3, M), np.nan)
        p2p = np.full((n, V, 2, M), np.nan)
        dp = np.full(n, np.nan)
        dp_start = np.full(n, np.nan)
        opt = np.full(n, np.nan)
        pending: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        tp_wait: FloatArray | None = None
        pos = index.pos
        for c in rec.chunks:
            i = pos.get(c.rank)
            if i is None:
                continue  # a spare or a rank outside the plan
            kind = c.kind
            if kind == "DP":
                dp[i] = c.end_s - c.start_s
                dp_start[i] = c.start_s
            elif kind == "OPT":
                opt[i] = c.end_s - c.start_s
            elif kind == "TP":
                if tp_wait is None:
                    tp_wait = np.full(n, np.nan)
                tp_wait[i] = (0.0 if np.isnan(tp_wait[i]) else tp_wait[i]) + (c.end_s - c.start_s)
            elif not (0 <= c.chunk < V and 0 <= c.microbatch < M):
                continue
            elif kind == "P2P":
                pending.setdefault((i, c.chunk, c.microbatch), []).append((c.start_s, c.end_s))
            else:
                k = 0 if kind == "F" else 1 if kind == "B" else 2
                compute[i, c.chunk, k, c.microbatch] = c.end_s - c.start_s
        # a rank receives at most one activation (before F) and one gradient (before B) per
        # (chunk, micro-batch); with both, the activation comes first
        for (i, v, m), spans in pending.items():
            has_f = index.pkey[i, v, FWD] >= 0
            has_b = index.pkey[i, v, BWD] >= 0
            spans.sort()
            if has_f and has_b and len(spans) >= 2:
                p2p[i, v, FWD, m] = spans[0][1] - spans[0][0]
                p2p[i, v, BWD, m] = spans[1][1] - spans[1][0]
            elif spans:
                d = FWD if has_f else BWD
                p2p[i, v, d, m] = spans[0][1] - spans[0][0]
        out.compute, out.p2p, out.dp, out.opt, out.tp_wait = compute, p2p, dp, opt, tp_wait
        out.dp_start = dp_start if np.isfinite(dp_start).any() else None
    if rec.rank_step_s:
        steps = np.full(n, np.nan)
        for r, t in rec.rank_step_s.items():
            i = index.pos.get(r)
            if i is not None:
                steps[i] = t
        out.rank_step = steps
    return out


def split_dp_wait(t: IterationTimings, index: PlanIndex) -> None:
    """A DP all-reduce span timed from when *this* rank entered it holds the wait for the
    ring's last arriver; only what follows that arrival is the ring's transfer. Sets
    ``t.dp`` to the transfer and ``t.dp_wait`` to the wait (evidence against the late
    replica, not the ring). Rings are the ranks of one (stage, TP index); a ring with one
    timed member, or spans without starts, are left as they are."""
    if t.dp is None or t.dp_start is None or t.dp_wait is not None:
        return
    timed = np.isfinite(t.dp) & np.isfinite(t.dp_start)
    # per ring (a row of ring_rows): the last arrival and how many members were timed
    members = index.ring_rows
    pad = members < 0
    at = np.where(timed, t.dp_start, -np.inf)[np.where(pad, 0, members)]
    at[pad] = -np.inf
    last = at.max(axis=1)
    counts = (timed[members] & ~pad).sum(axis=1)
    arrived = last[index.ring]
    ok = timed & (counts[index.ring] >= 2)
    start = np.where(timed, t.dp_start, np.nan)
    wait = np.where(ok, np.clip(arrived - start, 0.0, t.dp), 0.0)
    t.dp_wait = wait
    t.dp = t.dp - wait


def group_all(mask: npt.NDArray[np.bool_], index: PlanIndex) -> npt.NDArray[np.bool_]:
    """Per rank: whether every member of its TP group has ``mask``."""
    missing = np.bincount(index.group_of, weights=(~mask).astype(np.float64), minlength=index.n_groups) > 0
    out: npt.NDArray[np.bool_] = ~missing[index.group_of]
    return out


def tp_wait_share(compute: FloatArray, tp_wait: FloatArray, index: PlanIndex) -> FloatArray:
    """Per rank: the part of its compute spans that was not spent waiting for its TP group,
    in [0, 1]; 1 where the group has one member or a member recorded no TP time.

    Wall-clock spans of TP members are coupled by the collectives. The member that reaches a
    collective last waits least there: the least time any member spent inside the group's
    collectives is their own cost, and a member's time beyond it is waiting — for a partner
    still computing (a slow partner), or for one that came late from a pipeline receive,
    which is outside its compute spans (a stage-0 member whose partner waited for a slow
    stage-1 rank). Either way it is not this member's compute."""
    n = index.n
    span = np.nansum(compute.reshape(n, -1), axis=1)
    has = np.isfinite(tp_wait) & (index.tp_size > 1) & (span > 0)
    g = index.group_of
    full = group_all(has, index) & has
    least = np.full(index.n_groups, np.inf)
    np.minimum.at(least, g, np.where(full, tp_wait, np.inf))
    share = np.ones(n)
    share[full] = np.clip((span[full] - (tp_wait[full] - least[g][full])) / span[full], 0.0, 1.0)
    return share


# a member's compute excess this small beside a far slower TP partner is not confirmed: it costs
# the job nothing while the partner is there (a TP group's op lasts as long as its slowest
# member), and the partner confounds it — the wait for it left in the member's spans, or a
# co-tenant's load on a 2-GPU host that the host correction cannot measure when the host's other
# GPU is the slow one (in the noisy sweep a 2.08x rank's host and TP mate read 1.046x after 26
# iterations and was reported `degraded` on a healthy device). Capped: a larger excess beside a
# very slow partner is found, so that its baseline does not learn it.
TP_LEAK_SHARE = 0.1
TP_LEAK_CAP = 0.1


def shadowed_by_tp_partner(candidates: npt.NDArray[np.bool_], partners: npt.NDArray[np.bool_],
                           factor: FloatArray, index: PlanIndex) -> npt.NDArray[np.bool_]:
    """Per rank: a ``candidates`` rank whose excess (``factor`` - 1) is under ``TP_LEAK_SHARE``
    of the largest excess among the ``partners`` of its TP group (at most ``TP_LEAK_CAP``).
    Once a re-plan moves the partner off, the member's own timings judge it; a second slow
    device of one group, at 1.25x beside a 2x one, is more than that."""
    if not candidates.any() or int(index.tp_size.max(initial=1)) < 2:
        return np.zeros(index.n, dtype=np.bool_)
    f = np.where(np.isfinite(factor), factor, 1.0)
    worst = np.ones(index.n_groups)
    np.maximum.at(worst, index.group_of[partners], f[partners])
    partner_excess = worst[index.group_of] - 1.0
    bound = np.minimum(TP_LEAK_SHARE * partner_excess, TP_LEAK_CAP)
    return np.asarray(candidates & (partner_excess > 0.0) & (f - 1.0 < bound), dtype=np.bool_)


_GRID: dict[tuple[tuple[int, ...], int], tuple[IntArray, IntArray]] = {}


def batch_features(seqlens: tuple[tuple[tuple[int, ...], ...], ...], M: int) -> tuple[FloatArray, FloatArray]:
    """tokens[d, m] and Σl²[d, m] (NaN where replica d has fewer than m+1 micro-batches)."""
    D = len(seqlens)
    tok = np.full((D, M), np.nan)
    ssq = np.full((D, M), np.nan)
    shape = tuple(map(len, seqlens))
    if max(shape, default=0) > M:  # (M is the plan's most micro-batches: a batch never has more)
        shape = tuple(min(k, M) for k in shape)
        mbs = list(chain.from_iterable(rep[:M] for rep in seqlens))
    else:
        mbs = list(chain.from_iterable(seqlens))
    if not mbs:
        return tok, ssq
    counts = np.array(list(map(len, mbs)), dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(mbs), dtype=np.float64, count=int(counts.sum()))
    starts = np.zeros(len(mbs), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    grid = _GRID.get((shape, M))
    if grid is None:  # (replica, micro-batch) of every listed micro-batch, per batch shape
        d_idx = np.repeat(np.arange(D), shape)
        m_idx = np.concatenate([np.arange(k) for k in shape]).astype(np.int64)
        grid = _GRID[(shape, M)] = (d_idx, m_idx)
    tok[grid] = np.add.reduceat(flat, starts)
    ssq[grid] = np.add.reduceat(flat * flat, starts)
    return tok, ssq


def small_host_shift(values: FloatArray, hosts: npt.NDArray[np.int64], max_members: int = 3) -> FloatArray:
    """Per rank of a host with two or three ranks that have a value: the host's smallest
    value where it is positive (a slowdown every rank of the host shares), else NaN. Too few
    for a median, but a co-tenant slows all of a host's ranks while a slow device slows one:
    the least slowed rank bounds what the host itself does (a 2-GPU host under a co-tenant
    episode otherwise read 1.04-1.06x `degraded` on one of its ranks)."""
    out = np.full(len(values), np.nan)
    if hosts.shape[1] > max_members or hosts.shape[1] < 2:
        return out
    pad = hosts < 0
    v = np.where(pad, np.nan, values[np.where(pad, 0, hosts)])
    count = np.isfinite(v).sum(axis=1)
    low = np.where(count >= 2, np.nanmin(np.where(np.isfinite(v), v, np.inf), axis=1), np.nan)
    shared = np.where(np.isfinite(low) & (low > 0.0), low, np.nan)
    member = ~pad
    out[hosts[member]] = np.broadcast_to(shared[:, None], v.shape)[member]
    return out


def host_stats(values: FloatArray, hosts: npt.NDArray[np.int64], min_members: int = 4
               ) -> tuple[FloatArray, FloatArray]:
    """Per rank: the median and the robust spread (1.4826 x MAD) of ``values`` over the ranks
    of its host that have one, NaN where the host has fewer than ``min_members`` (the middle
    of two or three values is mostly chance). ``hosts``: ``PlanIndex.host_rows`` (a row of
    positions per host, -1 padded). Ranks of one host share its CPU, memory bus and power:
    when a co-tenant loads the host, all of them turn slower and noisier at once, which one
    rank's own history cannot know."""
    n = len(values)
    center, spread = np.full(n, np.nan), np.full(n, np.nan)
    if hosts.shape[1] < min_members:
        return center, spread
    pad = hosts < 0
    padded = bool(pad.any())  # hosts of equal size (the usual case) need no padding
    v = np.where(pad, np.nan, values[np.where(pad, 0, hosts)]) if padded else np.take(values, hosts)
    # finite values per host: a matrix-vector product (exact small integers), as sums along
    # short rows are slow
    count = (np.isfinite(v).astype(np.float64) @ np.ones(v.shape[1])).astype(np.int64)
    rows = np.arange(len(v))
    lo, hi = np.maximum((count - 1) // 2, 0), np.maximum(count // 2, 0)
    srt = np.sort(v, axis=1)  # NaN last
    med = 0.5 * (srt[rows, lo] + srt[rows, hi])
    dev = np.sort(np.abs(v - med[:, None]), axis=1)
    mad = 0.5 * (dev[rows, lo] + dev[rows, hi])
    enough = count >= min_members
    if not padded and enough.all():
        center[hosts] = med[:, None]
        spread[hosts] = 1.4826 * mad[:, None]
        return center, spread
    member = ~pad & enough[:, None]
    center[hosts[member]] = np.broadcast_to(med[:, None], v.shape)[member]
    spread[hosts[member]] = np.broadcast_to(1.4826 * mad[:, None], v.shape)[member]
    return center, spread
