"""What every simulated policy shares: settings, the policy interface, checkpoint
bookkeeping, spare nodes, and the layout helpers the baselines use (DP shrink, micro-batch
shares that minimise the makespan).

These helpers model the *baselines'* published mechanisms; resihp's own decisions come
from ``resihp.coordinator`` (see policies/resihp.py).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from resihp.coordinator.model.plan import PipelinePlan, Plan, even_split
from resihp.sim.engine import Context, Reaction
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.world import FailStop, World, WorldEvent


@dataclass(frozen=True)
class Settings:
    """Knobs shared by all policies so that the comparison is like for like.

    Defaults: asynchronous checkpoints (a 5 s stall to snapshot into host memory) every
    30 min — the runner sets the interval by Young's rule sqrt(2 · stall · MTBF) from the
    scenario's fail-stop rate, as an operator tuning for their failure rate would;
    a restart (reschedule, process launch, NCCL init, checkpoint load) of 5 min at 256 GPUs,
    longer at scale (see scenarios); a process exit noticed at once, a silent node after a
    30 s heartbeat timeout (the real detector's default), by every system alike; in-place regrouping (new communicators, no relaunch) of
    10 s for every system that can do it; fail-slow validation by profiling 30 s after the
    change-point detector flags (Greyhound, Adaptra)."""

    checkpoint_interval_s: float = 1800.0
    checkpoint_stall_s: float = 5.0  # snapshot to host memory; persisting is asynchronous
    restart_s: float = 300.0
    failstop_detect_s: float = 30.0  # heartbeat timeout for a node that goes silent
    regroup_s: float = 10.0
    failslow_detect_iters: int = 10
    failslow_validate_s: float = 30.0
    spare_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("checkpoint_interval_s", "checkpoint_stall_s", "restart_s", "failstop_detect_s", "regroup_s", "failslow_validate_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"settings: {name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_interval_s <= 0:
            raise ValueError("settings: checkpoint_interval_s must be > 0")


class Policy:
    """A resilience policy. Subclasses set ``name`` and ``source`` and override the hooks."""

    name = "policy"
    source = ""

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None) -> None:
        self.job = job
        self.perf = perf
        self.settings = settings or Settings()
        self.ctx: Context = Context(World(job.world_size, job.gpus_per_node))
        self.plan: Plan = job.initial_plan()
        # checkpoint bookkeeping: training since ``run_start`` checkpoints every interval
        self.run_start = 0.0

    # --- hooks ----------------------------------------------------------------------------
    def start(self, now: float) -> Reaction:
        return self.steady()

    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        return self.steady()

    def on_timer(self, tag: str, now: float) -> Reaction:
        return self.steady()

    # --- helpers --------------------------------------------------------------------------
    @property
    def world(self) -> World:
        return self.ctx.world

    def rate(self, plan: Plan | None = None, world: World | None = None, overlap_p2p: bool = False) -> float:
        return self.perf.tokens_per_s(plan or self.plan, world or self.world, overlap_p2p)

    def steady(self, note: str = "", **kw: object) -> Reaction:
        tps = self.rate()
        return Reaction(steady_tps=tps, steady_label=self.label_for(tps), note=note, **kw)  # type: ignore[arg-type]

    def label_for(self, tps: float) -> str:
        ff = self.__dict__.get("_ff")
        if ff is None:
            ff = self.perf.tokens_per_s(self.job.initial_plan(), World(self.job.world_size, self.job.gpus_per_node))
            self.__dict__["_ff"] = ff
        if tps <= 0:
            return "down"
        return "healthy" if tps >= 0.95 * ff else "degraded"

    def detect_stop_s(self, fault: object) -> float:
        """A process exit is seen at once by any agent watching pids (torchrun's, Oobleck's,
        resihp's); a node that goes silent only after the heartbeat timeout."""
        scope = getattr(fault, "scope", "node")
        return self.settings.failstop_detect_s if scope == "node" else 0.0

    def rollback_tokens(self, now: float) -> float:
        """Work since the last checkpoint (checkpoints every interval since the run began)."""
        if now <= self.run_start:
            return 0.0
        k = math.floor((now - self.run_start) / self.settings.checkpoint_interval_s)
        last = self.run_start + k * self.settings.checkpoint_interval_s
        return self.ctx.tokens_between(last, now)

    def inflight_tokens(self, now: float) -> float:
        """The iteration under way when a fail-stop hits is lost (half of one on average)."""
        t_iter = self.perf.iteration_s(self.plan, self.world)
        if not math.isfinite(t_iter):
            return 0.0
        return self.ctx.tokens_between(max(0.0, now - t_iter / 2.0), now)

    def plan_uses_dead(self, plan: Plan, world: World | None = None) -> bool:
        w = world or self.world
        return any(plan.has_rank(r) for r in w.dead_ranks())


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval, kept within [2 min, 1 h]."""
    return min(3600.0, max(120.0, math.sqrt(2.0 * stall_s * mtbf_s)))


# --- layout helpers shared by the baselines -----------------------------------------------
def node_ranks(job: JobSpec, node: int) -> range:
    return range(node * job.gpus_per_node, (node + 1) * job.gpus_per_node)


def usable_nodes(job: JobSpec, world: World, exclude: set[int] | None = None) -> list[int]:
    """Nodes whose every device is alive (and not excluded)."""
    bad = exclude or set()
    return [n for n in range(job.num_nodes) if n not in bad and all(world.alive(r) for r in node_ranks(job, n))]


def shrink_plan(job: JobSpec, plan: Plan, bad_ranks: set[int]) -> Plan | None:
    """Drop the replicas that touch ``bad_ranks`` and spread the global batch over the rest
    (gradient accumulation keeps the global batch): what an elastic restart does."""
    keep = [rep for rep in plan.replicas if not bad_ranks.intersection(rep.ranks())]
    if not keep:
        return None
    shares = even_split(job.microbatches, len(keep))
    reps = tuple(replace(rep, microbatches=m) for rep, m in zip(keep, shares))
    return Plan(reps, plan.schedule, plan.virtual_chunks, plan.epoch + 1, reason="shrunk: replicas with failed devices dropped")


def best_shares(times: Sequence[Callable[[int], float]], total: int) -> list[int]:
    """Integer micro-batch shares minimising the slowest replica's time (greedy on the
    marginal finishing time; exact for times non-decreasing and convex-ish in m)."""
    n = len(times)
    shares = [0] * n
    heap = [(times[i](1), i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total):
        t_next, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (times[i](shares[i] + 1), i))
    return shares


def rebalance(perf: PerfModel, plan: Plan, world: World, overlap_p2p: bool = False) -> Plan:
    """Same layout, micro-batch shares proportional to what each replica can do now."""
    job = perf.job
    funcs = []
    for i in range(plan.dp):
        try:
            costs = perf.replica_stage_costs(plan, i, world, overlap_p2p)
        except Exception:
            costs = None

        def f(m: int, c: object = costs) -> float:
            return math.inf if c is None else perf.pipeline_s(c, m)  # type: ignore[arg-type]

        funcs.append(f)
    shares = best_shares(funcs, job.microbatches)
    if shares == [rep.microbatches for rep in plan.replicas]:
        return plan
    reps = tuple(replace(rep, microbatches=m) for rep, m in zip(plan.replicas, shares))
    return Plan(reps, plan.schedule, plan.virtual_chunks, plan.epoch + 1, plan.spares, reason="micro-batch shares rebalanced")


def pipeline_from_nodes(job: JobSpec, nodes: Sequence[int], microbatches: int) -> PipelinePlan:
    """A pipeline over whole nodes: TP groups of ``job.tp`` consecutive devices, layers
    split as evenly as integers allow (Oobleck-style template instantiation)."""
    groups = []
    for n in nodes:
        rs = list(node_ranks(job, n))
        groups += [tuple(rs[i:i + job.tp]) for i in range(0, len(rs), job.tp)]
    layers = even_split(job.model.num_layers, len(groups))
    return PipelinePlan(tuple(groups), tuple(layers), microbatches)


@dataclass
class Spares:
    """A pool of hot-spare nodes that stand in for failed ones (checkpoint-restart with a
    spare node). A failed node, once repaired, joins the pool."""

    free: int
    standing_in: set[int] = field(default_factory=set)  # job ranks now served by a spare

    def cover(self, job: JobSpec, ranks: Sequence[int]) -> bool:
        nodes = sorted({r // job.gpus_per_node for r in ranks} - {r // job.gpus_per_node for r in self.standing_in})
        if len(nodes) > self.free:
            return False
        self.free -= len(nodes)
        for n in nodes:
            self.standing_in.update(node_ranks(job, n))
        return True

    def masked(self, world: World) -> World:
        """The world as the job sees it: ranks served by spares are healthy devices."""
        if not self.standing_in:
            return world
        key = (id(world), world.version, frozenset(self.standing_in))
        cached = self.__dict__.get("_masked")
        if cached is not None and cached[0] == key:
            return cached[1]  # type: ignore[no-any-return]
        gone = {r // world.gpus_per_node for r in self.standing_in}
        net = {n: f for n, f in world.net.items() if n not in gone}
        w = World(world.world_size, world.gpus_per_node, {}, {}, net, world.version)
        w.down = {r: ids for r, ids in world.down.items() if r not in self.standing_in}
        w.slow = {r: f for r, f in world.slow.items() if r not in self.standing_in}
        self.__dict__["_masked"] = (key, w)
        return w

    def on_repair(self, job: JobSpec, ev: WorldEvent, world: World) -> None:
        if isinstance(ev.fault, FailStop) and not ev.start:
            nodes = {r // job.gpus_per_node for r in ev.fault.ranks}
            for n in nodes:
                ranks = set(node_ranks(job, n))
                if ranks <= self.standing_in and all(world.alive(r) for r in ranks):
                    # the repaired node refills the pool; the stand-in keeps serving the job
                    self.standing_in -= ranks
                    self.free += 1
