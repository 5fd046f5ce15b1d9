"""Whether and how to re-plan: the ski-rental rule over the escalation ladder.

For every rung (dp-shares → layer-split → tp-regroup → full-replan) the planner predicts
the new iteration time and the reconfiguration cost ``move_bytes / bandwidth + fixed
latency``. A rung pays off when

    (1 − T_new / T_now) × expected remaining duration of the fault  >  reconfiguration cost

i.e. the training seconds it saves before the fault would have ended anyway outweigh the
seconds spent reconfiguring (Greyhound's ski rental). Among rungs that pay off the one with
the largest net saving wins, except that a cheaper rung whose predicted time is within
``equal_speed_tolerance`` of it is preferred (less state moves). A fail-stop always gets a
plan without the lost devices. Pure: time comes in as ``now``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from resihp.coordinator.cluster import Cluster, GlobalBatch
from resihp.coordinator.plan import Plan
from resihp.coordinator.planner_cost import INF, Costs, PlannerConfig, evaluate_with, plan_problems
from resihp.coordinator.planner_levels import regroup, reshare, resplit
from resihp.coordinator.planner_move import plan_move
from resihp.coordinator.planner_search import Searcher
from resihp.coordinator.spec import ModelSpec, SpecError

LEVELS = ("none", "dp-shares", "layer-split", "tp-regroup", "full-replan")


@dataclass(frozen=True)
class Candidate:
    level: str
    plan: Plan
    iteration_s: float
    move_bytes: int
    move_s: float
    cost_s: float  # move_s + fixed latency of the level


@dataclass(frozen=True)
class Decision:
    act: bool
    plan: Plan  # the chosen plan (the current one when act is False)
    reason: str
    predicted_iteration_s_before: float  # inf when the current plan cannot run (fail-stop)
    predicted_iteration_s_after: float
    tokens_per_s_before: float
    tokens_per_s_after: float
    move_bytes: int
    move_s: float
    level: str  # "none" | "dp-shares" | "layer-split" | "tp-regroup" | "full-replan"
    candidates: tuple[Candidate, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if x == INF else x

        return {
            "act": self.act,
            "level": self.level,
            "reason": self.reason,
            "predicted_iteration_s_before": num(self.predicted_iteration_s_before),
            "predicted_iteration_s_after": num(self.predicted_iteration_s_after),
            "tokens_per_s_before": self.tokens_per_s_before,
            "tokens_per_s_after": self.tokens_per_s_after,
            "move_bytes": self.move_bytes,
            "move_s": self.move_s,
            "plan": self.plan.to_dict(),
            "candidates": [
                {"level": c.level, "iteration_s": num(c.iteration_s), "move_bytes": c.move_bytes, "cost_s": c.cost_s}
                for c in self.candidates
            ],
        }


def apply_finding(cluster: Cluster, finding: Any | None) -> Cluster:
    """The cluster as the finding says it is now (duck-typed: kind, ranks, factor)."""
    if finding is None:
        return cluster
    kind = str(getattr(finding, "kind"))
    ranks: Sequence[int] = tuple(int(r) for r in getattr(finding, "ranks"))
    known = {d.rank for d in cluster.devices}
    unknown = sorted(set(ranks) - known)
    if unknown:
        raise SpecError(f"finding: rank(s) {unknown} are not in the cluster")
    if kind == "fail-stop":
        return cluster.with_failed(ranks)
    if kind == "fail-slow":
        factor = float(getattr(finding, "factor", 1.0))
        if not factor > 0:
            raise SpecError(f"finding: factor must be > 0, got {factor}")
        return cluster.with_speeds({r: min(cluster.device(r).speed, 1.0 / factor) for r in ranks})
    if kind == "recovered":
        return cluster.with_speeds({r: 1.0 for r in ranks})
    raise SpecError(f"finding: unknown kind {kind!r}; expected fail-slow, fail-stop or recovered")


def expected_remaining_s(finding: Any | None, config: PlannerConfig) -> float:
    cause = str(getattr(finding, "cause", "unknown")) if finding is not None else "unknown"
    if cause == "compute":
        return config.fault_compute_s
    if cause == "communication":
        return config.fault_communication_s
    return config.fault_unknown_s


def _candidates(costs: Costs, current: Plan, searcher: Searcher, cfg: PlannerConfig) -> list[Candidate]:
    spec = costs.spec
    bw = costs.cluster.inter_node_bw_Bps
    out: list[Candidate] = []
    builders: tuple[tuple[str, Callable[[], Plan | None], float], ...] = (
        ("dp-shares", lambda: reshare(costs, current), cfg.reshare_latency_s),
        ("layer-split", lambda: resplit(costs, current, searcher), cfg.reshare_latency_s),
        ("tp-regroup", lambda: regroup(costs, current, searcher), cfg.regroup_latency_s),
        ("full-replan", lambda: searcher.search().plan, cfg.regroup_latency_s),
    )
    for level, build, latency in builders:
        plan = build()
        if plan is None or plan_problems(plan, costs.cluster, spec, costs.batch, cfg):
            continue
        ev = evaluate_with(costs, plan)
        if ev.iteration_s == INF:
            continue
        move = plan_move(current, plan, spec, cfg.memory, bw)
        out.append(Candidate(level, plan, ev.iteration_s, move.bytes_total, move.seconds, move.seconds + latency))
    return out


def decide(
    cluster: Cluster,
    model: ModelSpec,
    batch: GlobalBatch,
    current: Plan,
    finding: Any | None,
    now: float,
    config: PlannerConfig | None = None,
) -> Decision:
    cfg = config or PlannerConfig()
    view = apply_finding(cluster, finding)
    unknown = sorted(set(current.ranks()) - {d.rank for d in view.devices})
    if unknown:
        raise SpecError(f"current plan: ranks {unknown} are not in the cluster")
    current.validate_for(model.num_layers, model.num_heads)
    costs = Costs(view, model, batch, cfg, current.schedule, current.virtual_chunks)
    searcher = Searcher(view, model, batch, current, cfg)
    problems = plan_problems(current, view, model, batch, cfg)
    dead = sorted(set(current.ranks()) & set(view.failed_ranks()))
    before = INF if problems else evaluate_with(costs, current).iteration_s
    tokens = batch.microbatches * batch.tokens_per_microbatch
    tps_before = 0.0 if before == INF else tokens / before
    cands = _candidates(costs, current, searcher, cfg)
    # noting the onset time is the caller's business; `now` keeps the signature pure and
    # lets callers discount a fault already in progress via the finding's time_s
    raw_onset = getattr(finding, "time_s", None) if finding is not None else None
    onset = now if raw_onset is None else float(raw_onset)
    remaining = max(0.0, expected_remaining_s(finding, cfg) - max(0.0, now - onset))
    what = _describe(finding, dead, problems)

    def keep(reason: str) -> Decision:
        return Decision(False, current, reason, before, before, tps_before, tps_before, 0, 0.0, "none", tuple(cands))

    if not cands:
        if dead or problems:
            raise SpecError(f"planner: {what}, and no layout of the healthy devices can run the model")
        return keep(f"{what}; no alternative layout is feasible, keeping the current plan")
    must_act = bool(problems)
    scored = []
    for c in cands:
        gain = 1.0 if before == INF else max(0.0, 1.0 - c.iteration_s / before)
        scored.append((c, gain, gain * remaining - c.cost_s))
    if must_act:
        # after a fail-stop: the fastest plan, the cheaper rung on near-ties (ladder order)
        best_time = min(c.iteration_s for c in cands)
        pick = next(t for t in scored if t[0].iteration_s <= best_time * (1 + cfg.equal_speed_tolerance))
        c = pick[0]
        reason = (
            f"{what}: the current plan cannot run; {c.level} gives a plan without them, predicted "
            f"{c.iteration_s:.3f} s/iteration, moving {c.move_bytes / 2**30:.1f} GiB in {c.move_s:.1f} s"
        )
        return _act(c, reason, before, tps_before, tokens, cands)
    worthwhile = [t for t in scored if t[1] >= cfg.min_gain_fraction and t[2] > 0]
    if not worthwhile:
        c, gain, _ = max(scored, key=lambda t: t[1])
        if gain < cfg.min_gain_fraction:
            return keep(
                f"{what}; the best re-plan ({c.level}) gains only {gain * 100:.1f} % "
                f"(< {cfg.min_gain_fraction * 100:.1f} %), keeping the current plan"
            )
        return keep(
            f"{what}; ski rental says wait: {c.level} would gain {gain * 100:.1f} % × {remaining:.0f} s expected "
            f"remaining = {gain * remaining:.1f} s < reconfiguration cost {c.cost_s:.1f} s"
        )
    top = max(worthwhile, key=lambda t: t[2])
    pick = top
    for t in worthwhile:  # in ladder order: the cheapest rung as fast as the best one
        if t[0].iteration_s <= top[0].iteration_s * (1 + cfg.equal_speed_tolerance):
            pick = t
            break
    c, gain, net = pick
    reason = (
        f"{what}; {c.level}: predicted {before:.3f} → {c.iteration_s:.3f} s/iteration, gain {gain * 100:.1f} % × "
        f"{remaining:.0f} s expected remaining = {gain * remaining:.1f} s > reconfiguration cost {c.cost_s:.1f} s "
        f"({c.move_bytes / 2**30:.1f} GiB moved)"
    )
    return _act(c, reason, before, tps_before, tokens, cands)


def _act(c: Candidate, reason: str, before: float, tps_before: float, tokens: int,
         cands: list[Candidate]) -> Decision:
    plan = Plan(c.plan.replicas, c.plan.schedule, c.plan.virtual_chunks, c.plan.epoch, c.plan.spares, reason)
    return Decision(True, plan, reason, before, c.iteration_s, tps_before, tokens / c.iteration_s,
                    c.move_bytes, c.move_s, c.level, tuple(cands))


def _describe(finding: Any | None, dead: list[int], problems: list[str]) -> str:
    if finding is None:
        if dead:
            return f"ranks {dead} have failed"
        if problems:
            return "the current plan cannot run (" + "; ".join(problems) + ")"
        return "no finding; checking the current plan against the cluster"
    kind = getattr(finding, "kind")
    ranks = list(getattr(finding, "ranks"))
    if kind == "fail-stop":
        return f"fail-stop of ranks {ranks}"
    if kind == "fail-slow":
        return f"fail-slow of ranks {ranks} (×{float(getattr(finding, 'factor', 1.0)):.2f} slower)"
    return f"ranks {ranks} recovered"
