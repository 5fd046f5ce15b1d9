"""Event-driven job simulation over segments of constant configuration.

The clock is simulated: nothing here reads wall time. Between two events (a fault starting
or ending, or a timer a policy asked for) the job runs at a constant rate, so a day of a
16,384-GPU job is a few hundred segments, not millions of iterations.

A policy answers every event with a ``Reaction``: optional transient ``phases`` (down for a
restart, paused for a reconfiguration), then a ``steady`` rate that holds until the next
event; work rolled back to a checkpoint (``lost_tokens``); counters; and timers (e.g.
"detection completes at t + d"). The engine integrates tokens along that program, keeps a
log of segments (for the plot) and the failure-free upper bound (failure-free rate × the
healthy fraction of compute, integrated over time).
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from resihp.sim.world import FailSlow, FailStop, Fault, World, WorldEvent

if TYPE_CHECKING:
    from resihp.sim.policies.base import Policy


@dataclass(frozen=True)
class Phase:
    duration_s: float
    tokens_per_s: float
    label: str  # "down", "restart", "reconfig", ...


@dataclass(frozen=True)
class Reaction:
    steady_tps: float
    steady_label: str = "run"
    phases: tuple[Phase, ...] = ()
    keep_phases: bool = True  # finish the transient phases already under way first
    lost_tokens: float = 0.0  # work rolled back (restart from a checkpoint, the in-flight iteration)
    reconfigurations: int = 0
    restarts: int = 0
    timers: tuple[tuple[float, str], ...] = ()  # (absolute time, tag) delivered to on_timer
    note: str = ""


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    tokens_per_s: float
    label: str


@dataclass(frozen=True)
class LogLine:
    time_s: float
    event: str
    note: str


@dataclass
class RunResult:
    policy: str
    horizon_s: float
    failure_free_tps: float
    tokens: float  # net of rolled-back work
    lost_tokens: float
    upper_bound_tokens: float
    reconfigurations: int
    restarts: int
    segments: list[Segment]
    log: list[LogLine]
    # the upper bound's rate over time, piecewise constant: (start, end, tokens/s)
    bound_segments: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def avg_tps(self) -> float:
        return self.tokens / self.horizon_s if self.horizon_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Net tokens over what the failure-free job would have trained."""
        ideal = self.failure_free_tps * self.horizon_s
        return self.tokens / ideal if ideal > 0 else 0.0

    @property
    def vs_upper_bound(self) -> float:
        return self.tokens / self.upper_bound_tokens if self.upper_bound_tokens > 0 else 0.0

    def time_below(self, fraction: float) -> float:
        """Seconds spent below ``fraction`` of the failure-free rate (down included)."""
        cut = fraction * self.failure_free_tps
        return sum(s.end_s - s.start_s for s in self.segments if s.tokens_per_s < cut)

    @property
    def degraded_s(self) -> float:
        return self.time_below(0.95)

    @property
    def down_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if s.tokens_per_s <= 0.0)


def loss_breakdown(res: RunResult) -> dict[str, float]:
    """Where a run's tokens fell short of the upper bound, as shares of the bound's tokens:
    per segment label (``down``, ``restart``, ``reconfig``, ``degraded``, ``healthy``, ...),
    the bound's tokens over the segment less those trained in it, plus ``rolled back`` (work
    trained and lost to a restore). They sum to 1 − ``vs_upper_bound`` (a segment above the
    bound counts negative)."""
    total = res.upper_bound_tokens
    if total <= 0:
        return {}
    out: dict[str, float] = {}
    bounds = res.bound_segments
    j = 0
    for seg in res.segments:
        credited = 0.0
        while j < len(bounds) and bounds[j][1] <= seg.start_s:
            j += 1
        k = j
        while k < len(bounds) and bounds[k][0] < seg.end_s:
            b0, b1, rate = bounds[k]
            credited += rate * max(0.0, min(b1, seg.end_s) - max(b0, seg.start_s))
            k += 1
        label = seg.label.split(":")[0]
        out[label] = out.get(label, 0.0) + (credited - seg.tokens_per_s * (seg.end_s - seg.start_s)) / total
    if res.lost_tokens:
        out["rolled back"] = res.lost_tokens / total
    return out


def expand(faults: Sequence[Fault], horizon_s: float) -> list[WorldEvent]:
    """Each fault becomes a start event and, if it ends within the horizon, an end event."""
    out: list[WorldEvent] = []
    for i, f in enumerate(sorted(faults, key=lambda x: (x.time_s, x.ranks))):
        if f.time_s >= horizon_s:
            continue
        out.append(WorldEvent(f.time_s, f, i, True))
        length = f.repair_s if isinstance(f, FailStop) else f.duration_s
        if math.isfinite(length) and f.time_s + length < horizon_s:
            out.append(WorldEvent(f.time_s + length, f, i, False))
    return out


@dataclass
class Context:
    """What the engine lends a policy while it runs: the true world, the clock, the log
    of tokens trained so far (for rollbacks)."""

    world: World
    now: float = 0.0
    _starts: list[float] = field(default_factory=list)
    _cum: list[float] = field(default_factory=list)  # tokens trained before each segment start
    _segs: list[Segment] = field(default_factory=list)

    def tokens_between(self, t0: float, t1: float) -> float:
        """Tokens trained in [t0, t1] (both within the past)."""
        return self._tokens_at(t1) - self._tokens_at(t0)

    def _tokens_at(self, t: float) -> float:
        if not self._segs or t <= self._segs[0].start_s:
            return 0.0
        i = bisect.bisect_right(self._starts, t) - 1
        seg = self._segs[i]
        return self._cum[i] + seg.tokens_per_s * (min(t, seg.end_s) - seg.start_s)


class Simulation:
    """Runs one policy over one fault schedule."""

    def __init__(self, policy: Policy, world_size: int, gpus_per_node: int, failure_free_tps: float,
                 bound_tps: float | None = None) -> None:
        self.policy = policy
        self.ctx = Context(World(world_size, gpus_per_node))
        self.r0 = failure_free_tps
        self.r_bound = max(failure_free_tps, bound_tps or 0.0)

    def _add_segment(self, start: float, end: float, tps: float, label: str) -> None:
        if end <= start:
            return
        ctx = self.ctx
        if ctx._segs and ctx._segs[-1].label == label and ctx._segs[-1].tokens_per_s == tps and ctx._segs[-1].end_s == start:
            last = ctx._segs[-1]
            ctx._segs[-1] = Segment(last.start_s, end, tps, label)
            return
        total = ctx._cum[-1] + ctx._segs[-1].tokens_per_s * (ctx._segs[-1].end_s - ctx._segs[-1].start_s) if ctx._segs else 0.0
        ctx._segs.append(Segment(start, end, tps, label))
        ctx._starts.append(start)
        ctx._cum.append(total)

    def run(self, faults: Sequence[Fault], horizon_s: float) -> RunResult:
        if not horizon_s > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon_s}")
        ctx = self.ctx
        heap: list[tuple[float, int, int, object]] = []
        seq = 0
        for ev in expand(faults, horizon_s):
            heapq.heappush(heap, (ev.time_s, 0, seq, ev))
            seq += 1
        log: list[LogLine] = []
        lost = 0.0
        reconf = restarts = 0
        bound = 0.0
        phases: list[tuple[float, float, str]] = []  # (end time, tps, label)
        steady = (0.0, "start")
        t = 0.0

        def advance(t_to: float) -> None:
            nonlocal t
            while t < t_to:
                if phases:
                    end, tps, label = phases[0]
                    stop = min(end, t_to)
                    self._add_segment(t, stop, tps, label)
                    t = stop
                    if stop >= end:
                        phases.pop(0)
                else:
                    self._add_segment(t, t_to, steady[0], steady[1])
                    t = t_to

        def apply(rx: Reaction, now: float, what: str) -> None:
            nonlocal phases, steady, lost, reconf, restarts, seq
            kept = phases if rx.keep_phases else []
            start = kept[-1][0] if kept else now
            new = list(kept)
            for ph in rx.phases:
                if ph.duration_s > 0:
                    start += ph.duration_s
                    new.append((start, ph.tokens_per_s, ph.label))
            phases = new
            steady = (rx.steady_tps, rx.steady_label)
            lost += rx.lost_tokens
            reconf += rx.reconfigurations
            restarts += rx.restarts
            for when, tag in rx.timers:
                if when < horizon_s:
                    heapq.heappush(heap, (max(when, now), 1, seq, tag))
                    seq += 1
            if rx.note or rx.phases or rx.lost_tokens:
                log.append(LogLine(now, what, rx.note))

        self.policy.ctx = ctx
        apply(self.policy.start(0.0), 0.0, "start")
        bound_segs: list[tuple[float, float, float]] = []

        def credit(until: float) -> float:
            rate = self.r_bound * ctx.world.healthy_compute_fraction()
            if until > t:
                bound_segs.append((t, until, rate))
            return rate * (until - t)

        while heap and heap[0][0] < horizon_s:
            when, _, _, payload = heapq.heappop(heap)
            bound += credit(when)
            advance(when)
            ctx.now = when
            if isinstance(payload, WorldEvent):
                ctx.world.apply(payload)
                apply(self.policy.on_world(payload, when), when, payload.label)
            else:
                apply(self.policy.on_timer(str(payload), when), when, f"timer {payload}")
        bound += credit(horizon_s)
        advance(horizon_s)
        ctx.now = horizon_s
        produced = ctx.tokens_between(0.0, horizon_s)
        return RunResult(
            policy=self.policy.name, horizon_s=horizon_s, failure_free_tps=self.r0,
            tokens=max(0.0, produced - lost), lost_tokens=lost, upper_bound_tokens=bound,
            reconfigurations=reconf, restarts=restarts, segments=list(ctx._segs), log=log,
            bound_segments=bound_segs,
        )


def describe(f: Fault) -> str:
    if isinstance(f, FailStop):
        return f"fail-stop {f.cause} ({f.scope}) ranks {list(f.ranks)[:4]}{'…' if len(f.ranks) > 4 else ''}"
    assert isinstance(f, FailSlow)
    return f"fail-slow {f.slow_kind} ×{f.factor:.2f} for {f.duration_s:.0f}s ranks {list(f.ranks)[:4]}"
