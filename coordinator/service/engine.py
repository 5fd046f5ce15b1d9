"""The decision logic the coordinator service runs, behind one small interface.

``Engine`` is what the service needs from a detector + planner pair: feed it trace
records, tick it for timeouts, ask it for a plan. ``make_engine`` returns the real one
(coordinator/detector/detector.py + the planner, adapted in ``coordinator/service/engine_real.py``) when those modules
are importable, else ``RuleEngine``: a small, transparent rule set (median-relative
compute time, heartbeat timeout, drop-the-broken-replica planning) that keeps the control
plane usable on its own. Pure: no grpc, time passed in.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from resihp.coordinator.model.plan import PipelinePlan, Plan, even_split
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.model.trace import (
    COMPUTE_KINDS,
    DeviceInfo,
    ExitEvent,
    HeartbeatEvent,
    IterationRecord,
    OpState,
    PlanChange,
    Record,
    TraceHeader,
)
from resihp.coordinator.protocol.messages import FindingInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineDecision:
    act: bool
    plan: Plan  # the new plan (epoch already raised) when act, else the current one
    reason: str
    level: str = "none"  # none | dp-shares | layer-split | tp-regroup | full-replan
    fatal: bool = False  # no viable plan exists: the job cannot go on


def shrink_past_the_dead(decision: EngineDecision, plan: Plan, dead: Sequence[int]) -> EngineDecision:
    """After a fail-stop that the decision answers by keeping the plan (the dead ranks held no
    shard: idle spares, excluded ranks): they are still in every trainer's MPI world, and the
    idle ranks that saw them die wait in the shrink, so the members must shrink too. Act with
    the same layout less the dead spares; the command's fail-stop prefix makes every trainer
    apply it through its recovery."""
    if decision.act or decision.fatal or not dead:
        return decision
    why = decision.reason if decision.reason.startswith("fail-stop") else f"fail-stop of ranks {list(dead)}; {decision.reason}"
    why += "; every trainer shrinks MPI past them and goes on with the same layout"
    kept = replace(plan, spares=tuple(r for r in plan.spares if r not in dead), reason=why)
    return replace(decision, act=True, plan=kept, reason=why)


class Engine(Protocol):
    header: TraceHeader  # the model and layout it prices
    name: str

    def observe(self, record: Record, now: float) -> list[FindingInfo]: ...
    def tick(self, now: float) -> list[FindingInfo]: ...
    def observe_op(self, rank: int, t: float, op: OpState) -> None: ...  # a heartbeat's op (in-flight judging)
    def suspects(self) -> dict[int, str]: ...  # rank -> healthy / suspect / slow / dead
    def rank_speed(self) -> dict[int, float]: ...
    def readmit(self, rank: int) -> bool: ...  # forget a slow verdict of a rank outside the plan
    # an idle rank's compute probe (coordinator/detector/probe.py); ValueError on a bad rank or duration
    def observe_probe(self, rank: int, probe_s: float, now: float) -> list[FindingInfo]: ...
    def probe_ratios(self) -> dict[int, float]: ...  # rank -> latest probe / the reliable ranks' median
    def decide(self, current: Plan, finding: FindingInfo | None, unavailable: frozenset[int], now: float,
               nodes: Mapping[int, str]) -> EngineDecision: ...
    def set_plan(self, plan: Plan, iteration: int) -> None: ...
    def set_model(self, header: TraceHeader) -> None: ...  # the trainers' model, before any iteration is judged
    def hang_after_s(self) -> float: ...  # no iteration for this long is a hang (detector "Hangs")
    def policy(self) -> dict[str, str]: ...
    def set_policy(self, updates: Mapping[str, str]) -> dict[str, str]: ...
    def profile_text(self) -> str: ...  # what prices the planner's plans (admin status)
    # a restarted coordinator: relearn what the job's trace lines hold; returns what it learnt from
    def warm_start(self, trace_lines: Iterable[str]) -> int: ...


def parse_float(key: str, value: str, minimum: float = 0.0) -> float:
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"policy {key} must be a number, got {value!r}") from None
    if not math.isfinite(out) or out < minimum:
        raise ValueError(f"policy {key} must be a finite number >= {minimum}, got {value!r}")
    return out


@dataclass
class RuleConfig:
    slow_threshold: float = 0.25  # compute > (1 + threshold) × median of peers counts as slow
    persistence: int = 3  # consecutive slow iterations before a finding
    heartbeat_timeout_s: float = 3.0
    warmup: int = 2  # iterations ignored at the start and after every plan change


@dataclass
class _RankTrack:
    slow_streak: int = 0
    ok_streak: int = 0
    state: str = "healthy"
    ratio: float = 1.0
    last_seen: float | None = None


class RuleEngine:
    """Fallback detector + planner; see the module docstring."""

    name = "rules"

    def __init__(self, header: TraceHeader, config: RuleConfig | None = None) -> None:
        self.header = header
        self.config = config or RuleConfig()
        self.plan = header.plan
        self._tracks: dict[int, _RankTrack] = {d.rank: _RankTrack() for d in header.devices}
        self._since_plan = 0
        self._iter_times: deque[float] = deque(maxlen=16)  # the latest iterations' times (hang_after_s)

    # --- detection --------------------------------------------------------------------
    def _track(self, rank: int) -> _RankTrack:
        return self._tracks.setdefault(rank, _RankTrack())

    def observe(self, record: Record, now: float) -> list[FindingInfo]:
        if isinstance(record, HeartbeatEvent):
            self._track(record.rank).last_seen = record.time_s
            return []
        if isinstance(record, ExitEvent):
            tr = self._track(record.rank)
            if tr.state == "dead":
                return []
            tr.state = "dead"
            return [FindingInfo(-1, "fail-stop", (record.rank,), "process-exit", 1.0,
                                f"rank {record.rank} exited (code {record.code})", now)]
        if isinstance(record, PlanChange):
            self.set_plan(record.plan, record.iteration)
            return []
        return self._iteration(record, now)

    def _iteration(self, rec: IterationRecord, now: float) -> list[FindingInfo]:
        if rec.time_s > 0:
            self._iter_times.append(rec.time_s)
        for rank in rec.rank_step_s:
            self._track(rank).last_seen = now
        self._since_plan += 1
        if self._since_plan <= self.config.warmup:
            return []
        work = self._compute_per_token(rec)
        if len(work) < 2:
            return []
        median = statistics.median(work.values())
        if median <= 0:
            return []
        out = []
        for rank, value in work.items():
            tr = self._track(rank)
            if tr.state == "dead":
                continue
            tr.ratio = value / median
            if tr.ratio > 1 + self.config.slow_threshold:
                tr.slow_streak, tr.ok_streak = tr.slow_streak + 1, 0
                if tr.state == "healthy":
                    tr.state = "suspect"
                if tr.slow_streak >= self.config.persistence and tr.state == "suspect":
                    tr.state = "slow"
                    out.append(FindingInfo(
                        rec.iteration, "fail-slow", (rank,), "compute", tr.ratio,
                        f"rank {rank} computed {tr.ratio:.2f}x the median of its peers per token for "
                        f"{tr.slow_streak} iterations (threshold {1 + self.config.slow_threshold:.2f}x)",
                        now, stage=self._pos(rank)[1], replica=self._pos(rank)[0],
                    ))
            else:
                tr.ok_streak, tr.slow_streak = tr.ok_streak + 1, 0
                if tr.state == "suspect":
                    tr.state = "healthy"
                elif tr.state == "slow" and tr.ok_streak >= self.config.persistence:
                    tr.state = "healthy"
                    out.append(FindingInfo(rec.iteration, "recovered", (rank,), "compute", tr.ratio,
                                           f"rank {rank} back to {tr.ratio:.2f}x the median", now))
        return out

    def _pos(self, rank: int) -> tuple[int | None, int | None]:
        if self.plan.has_rank(rank):
            p = self.plan.position(rank)
            return p.replica, p.stage
        return None, None

    def _compute_per_token(self, rec: IterationRecord) -> dict[int, float]:
        """Compute seconds per token of the rank's replica: chunk timings where given."""
        compute: dict[int, float] = {}
        for c in rec.chunks:
            if c.kind in COMPUTE_KINDS:
                compute[c.rank] = compute.get(c.rank, 0.0) + c.duration_s
        if not compute:
            compute = dict(rec.rank_step_s)
        out = {}
        for rank, secs in compute.items():
            rep, _ = self._pos(rank)
            if rep is None or rep >= len(rec.seqlens):
                continue
            tokens = sum(sum(mb) for mb in rec.seqlens[rep]) or 1
            out[rank] = secs / tokens
        return out

    def observe_op(self, rank: int, t: float, op: OpState) -> None:
        return None  # the rule engine judges iterations only

    def tick(self, now: float) -> list[FindingInfo]:
        out = []
        for rank, tr in self._tracks.items():
            if tr.state == "dead" or tr.last_seen is None or not self.plan.has_rank(rank):
                continue
            if now - tr.last_seen > self.config.heartbeat_timeout_s:
                tr.state = "dead"
                out.append(FindingInfo(-1, "fail-stop", (rank,), "heartbeat", 1.0,
                                       f"rank {rank} silent for {now - tr.last_seen:.1f} s "
                                       f"(heartbeat timeout {self.config.heartbeat_timeout_s} s)", now))
        return out

    def suspects(self) -> dict[int, str]:
        return {r: t.state for r, t in self._tracks.items()}

    def rank_speed(self) -> dict[int, float]:
        return {r: (0.0 if t.state == "dead" else 1.0 / max(t.ratio, 1.0) if t.state == "slow" else 1.0)
                for r, t in self._tracks.items()}

    def observe_probe(self, rank: int, probe_s: float, now: float) -> list[FindingInfo]:
        """The rule engine judges iterations only: a probe just says the rank is alive."""
        self._track(rank).last_seen = now
        return []

    def probe_ratios(self) -> dict[int, float]:
        return {}

    def profile_text(self) -> str:
        return "none: the rule engine compares ranks, it prices no plan"

    def warm_start(self, trace_lines: Iterable[str]) -> int:
        return 0  # its tracks re-warm from the live reports

    def set_model(self, header: TraceHeader) -> None:
        RuleEngine.__init__(self, header, self.config)  # nothing judged yet: start afresh

    def hang_after_s(self) -> float:
        times = sorted(self._iter_times)
        return max(2.0 * times[len(times) // 2], 1.0) if times else float("inf")

    def readmit(self, rank: int) -> bool:
        tr = self._tracks.get(rank)
        if tr is None or tr.state != "slow" or self.plan.has_rank(rank):
            return False
        tr.state, tr.ratio, tr.ok_streak, tr.slow_streak = "healthy", 1.0, 0, 0
        return True

    # --- planning ---------------------------------------------------------------------
    def decide(self, current: Plan, finding: FindingInfo | None, unavailable: frozenset[int], now: float,
               nodes: Mapping[int, str]) -> EngineDecision:
        speed = self.rank_speed()
        dead = {r for r, st in self.suspects().items() if st == "dead"}
        keep = [rep for rep in current.replicas if not any(r in unavailable for r in rep.ranks())]
        in_plan = {r for rep in keep for r in rep.ranks()}
        # alive ranks outside the kept replicas: spares (excluded ones stay there until readmitted)
        others = sorted(d.rank for d in self.header.devices if d.rank not in in_plan and d.rank not in dead)
        pool = [r for r in others if r not in unavailable and speed.get(r, 1.0) > 0]
        used: set[int] = set()
        # a healthy pool of spares as large as a replica becomes a replica again (readmission)
        shape = current.replicas[0]
        size = sum(len(g) for g in shape.stages)
        target = max(len(current.replicas), len(self.header.plan.replicas))  # the job's original DP degree
        while len(pool) >= size and len(keep) < target:
            take, pool = pool[:size], pool[size:]
            it = iter(take)
            stages = tuple(tuple(next(it) for _ in g) for g in shape.stages)
            keep.append(PipelinePlan(stages=stages, layers=shape.layers, microbatches=0))
            used.update(take)
        freed = set(others) - used
        if not keep:
            return EngineDecision(False, current, "no data-parallel replica is left without a dead or excluded "
                                  "rank; the rule planner cannot rebuild TP/PP groups", fatal=True)
        total = current.batch_microbatches(self.header.tokens_per_microbatch)  # whole micro-batches again
        rep_speed = [min(speed.get(r, 1.0) for r in rep.ranks()) or 1e-3 for rep in keep]
        shares = _proportional(total, rep_speed)
        replicas = tuple(replace(rep, microbatches=s, tokens=0) for rep, s in zip(keep, shares))
        spares = tuple(sorted(freed))
        if replicas == current.replicas and spares == current.spares:
            return EngineDecision(False, current, "the current plan is already the best the rule planner finds")
        level = "dp-shares" if len(replicas) == len(current.replicas) and spares == current.spares else "full-replan"
        why = finding.reason if finding is not None else "operator request"
        reason = f"{level}: {why}; replicas {len(current.replicas)}->{len(replicas)}, shares {list(shares)}"
        plan = replace(current, replicas=replicas, spares=spares, epoch=current.epoch + 1, reason=reason)
        return EngineDecision(True, plan, reason, level)

    def set_plan(self, plan: Plan, iteration: int) -> None:
        self.plan = plan
        self._since_plan = 0
        for tr in self._tracks.values():
            if tr.state in ("suspect", "slow"):
                tr.slow_streak, tr.ok_streak = 0, 0
                tr.state = "healthy" if tr.state == "suspect" else tr.state

    def policy(self) -> dict[str, str]:
        c = self.config
        return {"slow_threshold": str(c.slow_threshold), "persistence": str(c.persistence),
                "heartbeat_timeout_s": str(c.heartbeat_timeout_s), "warmup": str(c.warmup)}

    def set_policy(self, updates: Mapping[str, str]) -> dict[str, str]:
        c = self.config
        new = RuleConfig(c.slow_threshold, c.persistence, c.heartbeat_timeout_s, c.warmup)
        for key, value in updates.items():
            if key == "slow_threshold":
                new.slow_threshold = parse_float(key, value, 0.01)
            elif key in ("persistence", "warmup"):
                setattr(new, key, int(parse_float(key, value, 0 if key == "warmup" else 1)))
            elif key == "heartbeat_timeout_s":
                new.heartbeat_timeout_s = parse_float(key, value, 0.1)
            else:
                raise ValueError(f"unknown policy key {key!r}; known: {sorted(self.policy())}")
        self.config = new
        return self.policy()


def _proportional(total: int, weights: list[float]) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights`` (largest remainders)."""
    if total <= 0:
        return [0] * len(weights)
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    if len(weights) <= total and 0 in out:  # every replica keeps at least one micro-batch
        return even_split(total, len(weights)) if max(out) <= 1 else _lift_zeros(out)
    return out


def _lift_zeros(out: list[int]) -> list[int]:
    out = list(out)
    for i, v in enumerate(out):
        if v == 0:
            j = max(range(len(out)), key=lambda k: out[k])
            out[j] -= 1
            out[i] = 1
    return out


def build_header(model: ModelSpec, plan: Plan, world_size: int, job: str, tokens_per_microbatch: int = 0,
                 nodes: Mapping[int, str] | None = None) -> TraceHeader:
    nodes = nodes or {}
    devices = tuple(DeviceInfo(r, nodes.get(r, ""), 0) for r in range(world_size))
    return TraceHeader(model=model, plan=plan, devices=devices, job=job, tokens_per_microbatch=tokens_per_microbatch)


def make_engine(kind: str, header: TraceHeader, policy: Mapping[str, str] | None = None,
                links: Mapping[str, float] | None = None) -> Engine:
    """``real`` = detector + planner (fails loudly if missing); ``rules``; ``auto`` = real when importable.
    ``links``: Cluster fields (device_flops, bandwidths, latencies) the planner should assume."""
    if kind not in ("auto", "real", "rules"):
        raise ValueError(f"engine must be auto, real or rules, got {kind!r}")
    engine: Engine
    if kind in ("auto", "real"):
        try:
            from resihp.coordinator.service.engine_real import RealEngine
            engine = RealEngine(header, links=links)
        except ImportError as exc:
            if kind == "real":
                raise
            log.warning("detector/planner not importable (%s); using the rule engine", exc)
            engine = RuleEngine(header)
    else:
        engine = RuleEngine(header)
    if policy:
        engine.set_policy(policy)
    return engine
