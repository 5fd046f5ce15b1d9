"""Whether and how to re-plan: the ski-rental rule over the escalation ladder.

For every rung (dp-shares → layer-split → tp-regroup → replica-rebuild → full-replan) the planner predicts
the new iteration time and the reconfiguration cost ``move_bytes / bandwidth + fixed
latency``. A rung pays off when

    (1 − T_new / T_now) × expected remaining duration of the fault  >  reconfiguration cost × (1 + undo)

The expected remaining duration is the fault's mean residual life under the log-normal
duration statistics of its cause (heavy-tailed: it grows with the fault's age); a
fail-slow's re-plan is undone when the fault ends, so its cost is charged twice
(``undo = revert_weight``); after a recovery the horizon is ``recovery_horizon_s``.

i.e. the training seconds it saves before the fault would have ended anyway outweigh the
seconds spent reconfiguring (Greyhound's ski rental). Among rungs that pay off the one with
the largest net saving wins, except that a cheaper rung whose predicted time is within
``equal_speed_tolerance`` of it is preferred (less state moves). A fail-stop always gets a
plan without the lost devices. Pure: time comes in as ``now``.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.cost import (
    INF,
    Costs,
    PlannerConfig,
    cluster_tables,
    evaluate_with,
    failed_text,
    plan_problems,
)
from resihp.coordinator.planner.docshares import document_shares
from resihp.coordinator.planner.levels import rebuild, regroup, reshare, resplit
from resihp.coordinator.planner.move import Move, plan_move
from resihp.coordinator.planner.search import Searcher

# A predicted iteration shorter than this prices nothing real (a plan for a job with no runtime
# behind it, a profile of absurd speeds): such a decision is refused, never formatted.
MIN_PRICED_S = 1e-6
LEVELS = ("none", "dp-shares", "layer-split", "tp-regroup", "replica-rebuild", "earlier-plan", "full-replan")
# layouts a job left that a decision may return to (``decide``'s ``earlier``): the one a fault's
# re-plan left, and the one before it (a second fault during the first)
EARLIER_PLANS = 2


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
    level: str  # one of LEVELS
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


def check_priced(*times_s: float) -> None:
    """Refuse to decide (or write a reason) with a predicted iteration time that is zero, negative,
    non-finite or below ``MIN_PRICED_S``: "predicted 0.000 → 0.000 s/iteration, gain 15 %" is a bug."""
    bad = [t for t in times_s if not (math.isfinite(t) and t >= MIN_PRICED_S)]
    if bad:
        raise SpecError(f"planner: refusing a decision priced at {', '.join(f'{t:.3g}' for t in bad)} s/iteration "
                        f"(zero, non-finite or below {MIN_PRICED_S:g} s): the cost model has nothing real to price")


def fmt_s(x: float) -> str:
    """Seconds for a reason text: three decimals, three significant digits below 0.01 s."""
    return f"{x:.3f}" if x >= 0.01 else f"{x:.3g}"


def apply_finding(cluster: Cluster, finding: Any | None) -> Cluster:
    """The cluster as the finding says it is now (duck-typed: kind, ranks, factor)."""
    if finding is None:
        return cluster
    kind = str(finding.kind)
    ranks: Sequence[int] = tuple(int(r) for r in finding.ranks)
    devs = cluster_tables(cluster).devs
    unknown = sorted(set(ranks).difference(devs))
    if unknown:
        raise SpecError(f"finding: rank(s) {unknown} are not in the cluster")
    if kind == "fail-stop":
        return _edited(cluster, {r: {"failed": True} for r in ranks})
    if kind == "fail-slow":
        factor = float(getattr(finding, "factor", 1.0))
        if not factor > 0:
            raise SpecError(f"finding: factor must be > 0, got {factor}")
        if str(getattr(finding, "cause", "unknown")) == "communication":
            # a sick link: its transfers slow down, its compute does not
            return _edited(cluster, {r: {"link_factor": float(max(devs[r].link_factor, factor, 1.0))} for r in ranks})
        return _edited(cluster, {r: {"speed": float(min(devs[r].speed, 1.0 / factor))} for r in ranks})
    if kind == "recovered":  # speed and link back to 1
        return _edited(cluster, {r: {"speed": 1.0, "link_factor": 1.0} for r in ranks})
    raise SpecError(f"finding: unknown kind {kind!r}; expected fail-slow, fail-stop or recovered")


def _edited(cluster: Cluster, edits: dict[int, dict[str, Any]]) -> Cluster:
    """``cluster`` with the given fields of the given ranks replaced (what Cluster.with_failed,
    with_links and with_speeds do), touching only those devices: at 16K devices a scan per
    edited rank costs more than the rest of applying a finding. Clusters are values: when
    nothing changes, the same one is returned."""
    tab = cluster_tables(cluster)
    if all(getattr(tab.devs[r], k) == v for r, fields in edits.items() for k, v in fields.items()):
        return cluster  # the cluster already says so (a caller that applied the finding itself)
    devs = list(cluster.devices)
    for r, fields in edits.items():
        i = tab.index[r]
        devs[i] = replace(devs[i], **fields)
    return replace(cluster, devices=tuple(devs))


def _mean_s(finding: Any | None, config: PlannerConfig) -> float:
    cause = str(getattr(finding, "cause", "unknown")) if finding is not None else "unknown"
    if cause == "compute":
        return config.fault_compute_s
    if cause == "communication":
        return config.fault_communication_s
    return config.fault_unknown_s


def residual_life_s(mean_s: float, sigma: float, age_s: float) -> float:
    """E[T − age | T > age] for a log-normal duration T with this mean and shape sigma
    (sigma = 0: a fixed duration, so mean − age). Heavy-tailed: the older a fault, the
    longer it is expected to last."""
    if mean_s <= 0:
        return 0.0
    if age_s <= 0:
        return mean_s
    if sigma <= 0:
        return max(0.0, mean_s - age_s)
    mu = math.log(mean_s) - sigma * sigma / 2.0
    z = (math.log(age_s) - mu) / sigma
    tail = 0.5 * math.erfc(z / math.sqrt(2.0))
    tail_shift = 0.5 * math.erfc((z - sigma) / math.sqrt(2.0))
    if tail <= 1e-300:
        return age_s * sigma * sigma / max(math.log(age_s) - mu, 1e-9)  # asymptote of the log-normal tail
    return max(0.0, mean_s * tail_shift / tail - age_s)


def fault_age_s(finding: Any | None, now: float) -> float:
    """How long the fault has been going on at ``now``: since the finding's onset
    (``time_s``), plus the suspect iterations the detector watched before confirming it."""
    if finding is None:
        return 0.0
    raw = getattr(finding, "time_s", None)
    onset = now if raw is None else float(raw)
    evidence = getattr(finding, "evidence", None) or {}
    watched = float(evidence.get("suspect_iterations", 0.0)) * float(evidence.get("observed_iteration_s", 0.0))
    return max(0.0, now - onset) + max(0.0, watched)


def expected_remaining_s(finding: Any | None, config: PlannerConfig, now: float | None = None) -> float:
    """How long the gain of a re-plan lasts: a fault's mean residual life (by cause, from
    the fault statistics); after a recovery, the horizon until the next fault."""
    if finding is not None and str(getattr(finding, "kind", "")) == "recovered":
        return config.recovery_horizon_s
    age = fault_age_s(finding, now if now is not None else float(getattr(finding, "time_s", 0.0) or 0.0))
    return residual_life_s(_mean_s(finding, config), config.fault_sigma, age)


def _candidates(costs: Costs, current: Plan, searcher: Searcher, cfg: PlannerConfig,
                earlier: Sequence[Plan] = ()) -> list[Candidate]:
    spec = costs.spec
    bw = costs.cluster.inter_node_bw_Bps
    out: list[Candidate] = []

    def searched() -> tuple[Plan, Move | None, float | None]:
        res = searcher.search()
        # the search already priced the move from the current plan, and scored the plan with
        # a Costs of the same cluster, schedule and chunks as ``costs``: the same evaluation
        return res.plan, res.move, res.iteration_s

    def plain(build: Callable[[], Plan | None]) -> Callable[[], tuple[Plan | None, Move | None, float | None]]:
        return lambda: (build(), None, None)

    builders: tuple[tuple[str, Callable[[], tuple[Plan | None, Move | None, float | None]], float], ...] = (
        ("dp-shares", plain(lambda: reshare(costs, current)), cfg.reshare_latency_s),
        ("layer-split", plain(lambda: resplit(costs, current, searcher)), cfg.reshare_latency_s),
        ("tp-regroup", plain(lambda: regroup(costs, current, searcher)), cfg.regroup_latency_s),
        ("replica-rebuild", plain(lambda: rebuild(costs, current, searcher)), cfg.regroup_latency_s),
        *(("earlier-plan", plain(partial(_again, p, current)), cfg.regroup_latency_s) for p in earlier),
        ("full-replan", searched, cfg.regroup_latency_s),
        ("full-replan", lambda: _without_slow_links(costs, current, cfg), cfg.regroup_latency_s),
    )
    for level, build, latency in builders:
        plan, move, known_s = build()
        if plan is None or plan_problems(plan, costs.cluster, spec, costs.batch, cfg):
            continue
        if cfg.document_shares and not plan.document_shares:
            finer = document_shares(costs, plan)  # same groups and layers: the move is unchanged
            if finer is not None:
                plan, known_s = finer, None
        if cfg.uniform_tp_per_layer and not tp_uniform_per_layer(plan):
            continue
        it_s = evaluate_with(costs, plan).iteration_s if known_s is None else known_s
        if it_s == INF:
            continue
        if move is None:
            move = plan_move(current, plan, spec, cfg.memory, bw)
        out.append(Candidate(level, plan, it_s, move.bytes_total, move.seconds, move.seconds + latency))
    return out


def _again(earlier: Plan, current: Plan) -> Plan | None:
    """A layout the job ran before, as the next plan (None where it is the current one or
    runs another schedule: the costs price the current plan's)."""
    if earlier.replicas == current.replicas and earlier.spares == current.spares:
        return None
    if (earlier.schedule, earlier.virtual_chunks) != (current.schedule, current.virtual_chunks):
        return None
    return replace(earlier, epoch=current.epoch + 1, reason="earlier-plan")


def earlier_layouts(earlier: Sequence[Plan], left: Plan, taken: Plan) -> tuple[Plan, ...]:
    """The layouts to offer ``decide`` as ``earlier`` once the job leaves ``left`` for
    ``taken``: ``left`` first, then the ones before it, none twice and never ``taken``, at most
    ``EARLIER_PLANS`` (the coordinator's engine and the simulator keep them alike)."""
    if left.replicas == taken.replicas and left.spares == taken.spares:
        return tuple(earlier)
    older = [p for p in earlier if p.replicas not in (left.replicas, taken.replicas)]
    return tuple([left, *older][:EARLIER_PLANS])


def tp_uniform_per_layer(plan: Plan) -> bool:
    """Whether every replica splits each layer (and the embedding and head, held by the first
    and last stage) over the same TP size."""
    seen: list[int] | None = None
    for rep in plan.replicas:
        sizes = [len(g) for g, n in zip(rep.stages, rep.layers) for _ in range(n)]
        sizes = [len(rep.stages[0])] + sizes + [len(rep.stages[-1])]
        if seen is not None and sizes != seen:
            return False
        seen = sizes
    return True


def _without_slow_links(costs: Costs, current: Plan, cfg: PlannerConfig
                        ) -> tuple[Plan | None, Move | None, float | None]:
    """The joint search over the devices whose links are healthy (link-slow ones become
    spares), with its move and score (its plan uses none of the edited devices, so the
    search's evaluation and move are those of ``costs``); None when no link is slow or
    nothing else can run the model."""
    tab = cluster_tables(costs.cluster)
    slow = [r for r in tab.slow_links if r not in tab.failed]  # link factors are >= 1: != 1 is > 1
    if not slow:
        return None, None, None
    try:
        res = Searcher(_edited(costs.cluster, {r: {"failed": True} for r in slow}), costs.spec, costs.batch, current,
                       cfg).search()
    except SpecError:
        return None, None, None
    return res.plan, res.move, res.iteration_s


def _finding_cost_cap(finding: Any | None) -> float | None:
    """The most a re-plan can gain against a fail-slow finding that says what it costs
    (``evidence.cost_share`` s: the iteration is 1 + s times the healthy one, so at most
    s / (1 + s) of it can be won back); None when it does not say. The detector's own
    ``Finding`` (what the coordinator passes) carries ``evidence``; the control plane's
    ``FindingInfo`` carries it in ``extra["evidence"]``."""
    evidence = getattr(finding, "evidence", None)
    if not isinstance(evidence, Mapping):
        extra = getattr(finding, "extra", None)
        evidence = extra.get("evidence") if isinstance(extra, Mapping) else None
    share = evidence.get("cost_share") if isinstance(evidence, Mapping) else None
    if not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
        return None
    return float(share) / (1.0 + float(share))


def decide(
    cluster: Cluster,
    model: ModelSpec,
    batch: GlobalBatch,
    current: Plan,
    finding: Any | None,
    now: float,
    config: PlannerConfig | None = None,
    excluded: Collection[int] = (),
    earlier: Sequence[Plan] = (),
) -> Decision:
    """``excluded``: ranks the cluster marks failed because the operator took them out
    (alive, not faulty): the reason names them as excluded, not as failed. ``earlier``:
    layouts the job ran before this one (most recent first), each a candidate again where
    its devices can run it: the undo of a fault's re-plan once the fault ends, which the
    search from the current layout need not find (after a node loss and a slow NIC the
    search stayed on a 3-stage layout 2.9 % slower than the 4-stage one it had left)."""
    cfg = config or PlannerConfig()
    view = apply_finding(cluster, finding)
    tab = cluster_tables(view)
    unknown = sorted(set(current.ranks()).difference(tab.devs))
    if unknown:
        raise SpecError(f"current plan: ranks {unknown} are not in the cluster")
    current.validate_for(model.num_layers, model.num_heads)
    costs = Costs(view, model, batch, cfg, current.schedule, current.virtual_chunks)
    searcher = Searcher(view, model, batch, current, cfg)
    excluded = frozenset(excluded)
    problems = plan_problems(current, view, model, batch, cfg, excluded)
    dead = sorted(tab.failed.intersection(current.ranks()))
    before = INF if problems else evaluate_with(costs, current).iteration_s
    if before != INF:
        check_priced(before)
    tokens = batch.microbatches * batch.tokens_per_microbatch
    tps_before = 0.0 if before == INF else tokens / before
    cands = _candidates(costs, current, searcher, cfg, earlier)
    if cfg.keep_replicas and current.dp >= 2 and any(c.plan.dp >= 2 for c in cands):
        # a faster plan without a replica would turn the next fail-stop into a checkpoint
        # restore (or the end of a job with none): PlannerConfig.keep_replicas
        cands = [c for c in cands if c.plan.dp >= 2]
    # noting the onset time is the caller's business; `now` keeps the signature pure and
    # lets callers discount a fault already in progress via the finding's time_s
    remaining = expected_remaining_s(finding, cfg, now)
    # a transient fault's re-plan is undone when it ends: that second move is charged too
    transient = finding is not None and str(getattr(finding, "kind", "")) == "fail-slow"
    undo = cfg.revert_weight if transient else 0.0
    what = _describe(finding, dead, problems, excluded)

    def keep(reason: str) -> Decision:
        return Decision(False, current, reason, before, before, tps_before, tps_before, 0, 0.0, "none", tuple(cands))

    if not cands:
        if dead or problems:
            raise SpecError(f"planner: {what}, and no layout of the healthy devices can run the model")
        return keep(f"{what}; no alternative layout is feasible, keeping the current plan")
    must_act = bool(problems)
    # the detector's price of the finding (the schedule simulation with that rank slow against
    # all healthy): routing around the fault wins back at most what it costs
    cap = _finding_cost_cap(finding)
    scored = []
    for c in cands:
        gain = 1.0 if before == INF else max(0.0, 1.0 - c.iteration_s / before)
        if not must_act and cap is not None:
            gain = min(gain, cap)
        scored.append((c, gain, gain * remaining - c.cost_s * (1.0 + undo)))
    if must_act:
        # after a fail-stop: the fastest plan, the cheaper rung on near-ties (ladder order)
        best_time = min(c.iteration_s for c in cands)
        pick = next(t for t in scored if t[0].iteration_s <= best_time * (1 + cfg.equal_speed_tolerance))
        c = pick[0]
        check_priced(c.iteration_s)
        reason = (
            f"{what}: the current plan cannot run; {c.level} gives a plan without them, predicted "
            f"{fmt_s(c.iteration_s)} s/iteration, moving {c.move_bytes / 2**30:.1f} GiB in {c.move_s:.1f} s"
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
            + (f" + {c.cost_s * undo:.1f} s to undo it when the fault ends" if undo else "")
        )
    top = max(worthwhile, key=lambda t: t[2])
    pick = top
    for t in worthwhile:  # in ladder order: the cheapest rung as fast as the best one
        if t[0].iteration_s <= top[0].iteration_s * (1 + cfg.equal_speed_tolerance):
            pick = t
            break
    c, gain, net = pick
    check_priced(before, c.iteration_s)
    reason = (
        f"{what}; {c.level}: predicted {fmt_s(before)} → {fmt_s(c.iteration_s)} s/iteration, gain {gain * 100:.1f} % × "
        f"{remaining:.0f} s expected remaining = {gain * remaining:.1f} s > reconfiguration cost {c.cost_s:.1f} s"
        + (f" + {c.cost_s * undo:.1f} s to undo it when the fault ends" if undo else "")
        + f" ({c.move_bytes / 2**30:.1f} GiB moved)"
    )
    return _act(c, reason, before, tps_before, tokens, cands)


def _act(c: Candidate, reason: str, before: float, tps_before: float, tokens: int,
         cands: list[Candidate]) -> Decision:
    # the candidate with the reason stamped on; a copy, not a new Plan: re-validating a
    # 16K-rank plan costs more than the rest of the decision
    plan = copy.copy(c.plan)
    object.__setattr__(plan, "reason", reason)
    return Decision(True, plan, reason, before, c.iteration_s, tps_before, tokens / c.iteration_s,
                    c.move_bytes, c.move_s, c.level, tuple(cands))


def _describe(finding: Any | None, dead: list[int], problems: list[str], excluded: frozenset[int] = frozenset()) -> str:
    if finding is None:
        if dead:
            return failed_text(dead, excluded)
        if problems:
            return "the current plan cannot run (" + "; ".join(problems) + ")"
        return "no finding; checking the current plan against the cluster"
    kind = finding.kind
    ranks = list(finding.ranks)
    if kind == "fail-stop":
        return f"fail-stop of ranks {ranks}"
    if kind == "fail-slow":
        return f"fail-slow of ranks {ranks} (×{float(getattr(finding, 'factor', 1.0)):.2f} slower)"
    return f"ranks {ranks} recovered"
