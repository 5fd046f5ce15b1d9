"""What bench/runtime.py reads from its traces: host speed, hook-overhead interval, model errors.

``analyse`` calibrates the cost model on the first half of a layout's trace and scores the
micro-batch (MTP) and iteration (ITP) predictions on the second half, either with every rank a
device of its own or, given the host's speed (``host_speed``, from the busy-loop probe),
through the shared-host processor-sharing simulator. Pure: numpy, the cost model and the
schedule simulator.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def overhead_interval(with_: list[float], without: list[float], seed: int = 0, draws: int = 2000
                      ) -> tuple[float, float]:
    """90 % bootstrap interval of median(with) / median(without), resampling the (with, without)
    block pairs together (block i of each mode ran back to back): how far the ratio could move
    by chance alone, which the goal of 1.005 needs to be read against."""
    import random

    pairs = list(zip(with_, without))
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(w for w, _ in draw) / statistics.median(o for _, o in draw)
        for draw in ([rng.choice(pairs) for _ in pairs] for _ in range(draws))
    )
    return ratios[int(0.05 * (draws - 1))], ratios[int(0.95 * (draws - 1))]


def host_speed(busy: dict[str, Any]) -> list[float]:
    """A rank's speed while k ranks compute (k = 1..ranks), relative to a rank alone: the host
    gives k busy ranks its throughput (the probe's total with every rank busy) shared
    equally, and never more than one rank alone gets."""
    alone = float(busy["alone"])
    together = [float(x) for x in busy["together"]]
    throughput = sum(together) / alone  # in units of "one rank alone"
    return [min(1.0, throughput / k) for k in range(1, len(together) + 1)]


def mape(pred: list[float], obs: list[float]) -> float:
    return sum(abs(p - o) / o for p, o in zip(pred, obs)) / max(1, len(obs))


BUSY_KINDS = ("F", "B", "OPT")  # chunks that compute on the rank's core (P2P and DP wait, mostly)


def _busy(rec: Any) -> dict[int, list[tuple[float, float]]]:
    out: dict[int, list[tuple[float, float]]] = {}
    for c in rec.chunks:
        if c.kind in BUSY_KINDS and c.end_s > c.start_s:
            out.setdefault(c.rank, []).append((c.start_s, c.end_s))
    return out


def _op_gaps(rec: Any) -> list[float]:
    """Per rank, the time of its step outside every recorded chunk, per F or B op: the runtime's
    own work between ops (Python, bookkeeping, posting messages), which the chunks do not time."""
    out = []
    by_rank: dict[int, list[Any]] = {}
    for c in rec.chunks:
        by_rank.setdefault(c.rank, []).append(c)
    for chunks in by_rank.values():
        ops = sum(1 for c in chunks if c.kind in ("F", "B"))
        if ops:
            span = max(c.end_s for c in chunks) - min(c.start_s for c in chunks)
            # a TP chunk lies inside its F or B op: not time of its own
            out.append(max(0.0, span - sum(c.duration_s for c in chunks if c.kind != "TP")) / ops)
    return out


def mean_speed(rank: int, start: float, end: float, busy: dict[int, list[tuple[float, float]]],
               speed: list[float]) -> float:
    """The mean speed ``rank`` ran at over [start, end): speed[k-1] while k ranks of the host
    (this one included) were busy, from the other ranks' recorded compute chunks."""
    from resihp.coordinator.schedule.shared_host import speed_for

    if end <= start:
        return 1.0
    edges = [(start, 0), (end, 0)]
    for r, spans in busy.items():
        if r == rank:
            continue
        for s, e in spans:
            if e > start and s < end:
                edges += [(max(s, start), 1), (min(e, end), -1)]
    edges.sort()
    total, others, t = 0.0, 0, start
    for at, delta in edges:
        total += (at - t) * speed_for(speed, 1 + others)
        t, others = at, others + delta
    return total / (end - start)


def analyse(path: Path, speed: list[float] | None = None) -> dict[str, Any]:
    """Calibrate on the first half of a layout's trace, score micro-batch and iteration time on
    the rest. ``speed`` (the host's, ``host_speed``): the shared-host model — chunk costs are
    calibrated as a rank alone would run them and predicted through the processor-sharing
    simulator (coordinator.schedule_shared); without it every rank is a device of its own
    (coordinator.schedule.simulate_iteration)."""
    from resihp.coordinator.model.costmodel import Calibrator
    from resihp.coordinator.model.plan import Schedule
    from resihp.coordinator.model.trace import IterationRecord, load_trace
    from resihp.coordinator.schedule.orders import B as KIND_B
    from resihp.coordinator.schedule.orders import F as KIND_F
    from resihp.coordinator.schedule.shared_host import simulate_shared
    from resihp.coordinator.schedule.simulator import ReplicaWork, simulate_iteration

    header, recs = load_trace(str(path))
    its = [r for r in recs if isinstance(r, IterationRecord)]
    plan = header.plan
    half = len(its) // 2
    train, test = its[:half], its[half:]
    cal = Calibrator(window=512, min_samples=4)
    p2p: list[float] = []
    dp_s: list[float] = []
    opt_s: list[float] = []
    gaps: list[float] = []

    def per_mb(rec: IterationRecord) -> dict[tuple[int, int], dict[str, Any]]:
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for c in rec.chunks:
            if c.kind in ("F", "B"):
                out.setdefault((c.rank, c.microbatch), {})[c.kind] = c
        return out

    for rec in train:
        busy = _busy(rec) if speed else {}
        for (rank, mb), kinds in per_mb(rec).items():
            lens = rec.seqlens[plan.position(rank).replica][mb]
            for kind, c in kinds.items():
                solo = c.duration_s * (mean_speed(rank, c.start_s, c.end_s, busy, speed) if speed else 1.0)
                cal.add((rank, kind), lens, solo)
        by_rank_dp = [c.duration_s for c in rec.chunks if c.kind == "DP"]
        if by_rank_dp:
            dp_s.append(min(by_rank_dp))  # the last rank to arrive waits least: the all-reduce itself
        opt_s += [c.duration_s for c in rec.chunks if c.kind == "OPT"]
        p2p += [c.duration_s for c in rec.chunks if c.kind == "P2P" and c.microbatch >= 0]
        gaps += _op_gaps(rec)
    op_gap = statistics.median(gaps) if gaps else 0.0  # the runtime's own time per F or B op
    p2p_lat = sorted(p2p)[len(p2p) // 10] if p2p else 0.0  # a transfer nobody waited for
    dp_lat, opt_lat = (statistics.median(dp_s) if dp_s else 0.0), (statistics.median(opt_s) if opt_s else 0.0)
    dp_sync = dp_lat if plan.dp > 1 else 0.0
    mb_pred: list[float] = []
    mb_obs: list[float] = []
    it_pred: list[float] = []
    it_obs: list[float] = []
    # the observed iteration time is the period, start to start: a record's own span (first
    # rank's start to last rank's end) also counts the skew between ranks — a last stage that
    # ended the previous iteration early starts this one early and waits for its input
    period = {a.iteration: b.start_s - a.start_s for a, b in zip(its, its[1:]) if b.iteration == a.iteration + 1}
    test = [rec for rec in test if rec.iteration in period] or test
    for rec in test:
        live = [(r_idx, rep) for r_idx, rep in enumerate(plan.replicas) if rep.microbatches]
        # an op takes its chunk's cost plus the runtime's time around it (the schedule simulator's
        # ops run back to back; the runtime's do not)
        tables = {r_idx: ([[cal.predict((g[0], "F"), rec.seqlens[r_idx][i]) + op_gap for i in range(rep.microbatches)]
                           for g in rep.stages],
                          [[cal.predict((g[0], "B"), rec.seqlens[r_idx][i]) + op_gap for i in range(rep.microbatches)]
                           for g in rep.stages]) for r_idx, rep in live}
        if speed:
            res = simulate_shared(Schedule(plan.schedule), [tables[r][0] for r, _ in live],
                                  [tables[r][1] for r, _ in live], host_of=[[0] * rep.pp for _, rep in live],
                                  width=[[len(g) for g in rep.stages] for _, rep in live], host_speed=speed,
                                  p2p_s=p2p_lat, dp_sync_s=dp_sync, optimizer_s=opt_lat)
            it_pred.append(res.iteration_s)
            where = {r: i for i, (r, _) in enumerate(live)}

            def predicted(rank: int, mb: int) -> float:
                pos = plan.position(rank)
                i, pp = where[pos.replica], plan.replicas[pos.replica].pp
                fs, fe = res.op_span(i, KIND_F, pos.stage, mb, pp)
                bs, be = res.op_span(i, KIND_B, pos.stage, mb, pp)
                return (fe - fs) + (be - bs) - 2 * op_gap  # the chunks alone, as recorded
        else:
            works = [ReplicaWork(f=tables[r][0], b=tables[r][1], pp=rep.pp) for r, rep in live]
            it_pred.append(simulate_iteration(plan.schedule, works, dp_sync_s=dp_sync, optimizer_s=opt_lat,
                                              p2p_s=p2p_lat).iteration_s)

            def predicted(rank: int, mb: int) -> float:
                lens = rec.seqlens[plan.position(rank).replica][mb]
                return float(cal.predict((rank, "F"), lens) + cal.predict((rank, "B"), lens))
        it_obs.append(period.get(rec.iteration, rec.time_s))
        for (rank, mb), kinds in per_mb(rec).items():
            if set(kinds) != {"F", "B"}:
                continue
            mb_pred.append(predicted(rank, mb))
            mb_obs.append(kinds["F"].duration_s + kinds["B"].duration_s)
    return {"mtp_mape": mape(mb_pred, mb_obs), "itp_mape": mape(it_pred, it_obs),
            "mb_samples": len(mb_obs), "iterations": len(it_obs),
            "iteration_s": statistics.median(r.time_s for r in its)}
