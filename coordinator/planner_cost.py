"""How fast a layout runs: stage times, the best layer split of a pipeline, and the one
evaluation function every plan (searched, exhaustive, current) is scored with.

Stage time for one micro-batch on a TP group of k devices whose slowest member has speed p:

    t = (layers · layer_flops + extras) / (k · p · device_flops) + layers · tp_comm(k)

with FLOPs from the cost model (``costmodel.layer_flops`` etc., F+B+W) and tp_comm the four
ring all-reduces per layer of Megatron TP inside a node. A pipeline of stages t_s running m
micro-batches takes Oobleck's closed form ``Σ t_s·β + (m − 1)·max t_s`` plus the p2p hops,
β = 1 for 1F1B, 1/v for interleaved 1F1B, 1/3 for ZB-H1 (the bubble shrinks with them).
An iteration is the slowest replica + the DP gradient all-reduce + the optimizer step.
Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from resihp.coordinator.cluster import Cluster, GlobalBatch
from resihp.coordinator.costmodel import embedding_flops, head_flops, layer_flops
from resihp.coordinator.memory import MemoryModel, inflight_microbatches, max_layers_fitting, stage_device_bytes
from resihp.coordinator.plan import Plan, Schedule
from resihp.coordinator.spec import ModelSpec, SpecError

INF = float("inf")


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the planner; all have documented defaults (docs/plan-inputs.md)."""

    memory: MemoryModel = field(default_factory=MemoryModel)
    grad_reduce_bytes: float = 2.0  # bytes per gradient element in the DP all-reduce (bf16)
    hbm_bw_Bps: float = 2e12  # optimizer step is memory-bound
    max_tp: int = 0  # 0 = the largest power of two that fits a node
    # ski rental
    fault_compute_s: float = 600.0  # expected remaining duration of a compute fail-slow (Greyhound: ~10 min)
    fault_communication_s: float = 1440.0  # of a communication fail-slow (~24 min)
    fault_unknown_s: float = 4320.0  # unknown cause: the 72-min mean of all fail-slows
    reshare_latency_s: float = 0.5  # change only the data-loader shares
    regroup_latency_s: float = 10.0  # rebuild communicators and restart the pipeline
    equal_speed_tolerance: float = 0.005  # plans within 0.5 % count as equally fast
    min_gain_fraction: float = 0.01  # gains below 1 % of the iteration are noise

    def __post_init__(self) -> None:
        for name in (
            "grad_reduce_bytes", "hbm_bw_Bps", "fault_compute_s", "fault_communication_s", "fault_unknown_s",
            "reshare_latency_s", "regroup_latency_s", "equal_speed_tolerance", "min_gain_fraction",
        ):
            if getattr(self, name) < 0:
                raise SpecError(f"planner config: {name} must be >= 0, got {getattr(self, name)}")
        if self.max_tp < 0:
            raise SpecError(f"planner config: max_tp must be >= 0, got {self.max_tp}")


# A stage as the cost model sees it: (tp size, slowest member's speed, smallest member memory)
StageKey = tuple[int, float, float]


@dataclass(frozen=True)
class PipeSig:
    """A pipeline up to renaming of devices: its stages in order. Every stage edge is priced
    at the inter-node link (pessimistic for a pipeline inside one node, and it keeps
    pipelines on interchangeable nodes identical, which the search relies on)."""

    stages: tuple[StageKey, ...]


def bubble_factor(schedule: Schedule, virtual_chunks: int) -> float:
    if schedule is Schedule.INTERLEAVED:
        return 1.0 / max(1, virtual_chunks)
    if schedule is Schedule.ZB_H1:
        return 1.0 / 3.0
    return 1.0


class Costs:
    """Everything the search needs to score layouts for one (cluster, model, batch)."""

    def __init__(
        self,
        cluster: Cluster,
        spec: ModelSpec,
        batch: GlobalBatch,
        config: PlannerConfig,
        schedule: Schedule = Schedule.ONE_F_ONE_B,
        virtual_chunks: int = 1,
    ) -> None:
        self.cluster = cluster
        self.spec = spec
        self.batch = batch
        self.config = config
        self.schedule = schedule
        self.v = virtual_chunks if schedule is Schedule.INTERLEAVED else 1
        seqlens = batch.typical_seqlens()
        lf = layer_flops(spec, seqlens, 1)
        self.layer_flops = lf.total
        self.fwd_fraction = lf.f / lf.total if lf.total > 0 else 1.0 / 3.0
        self.bwd_input_fraction = lf.b / lf.total if lf.total > 0 else 1.0 / 3.0
        self.first_flops = embedding_flops(spec, seqlens, 1).total
        self.last_flops = head_flops(spec, seqlens, 1).total
        self.tokens = batch.tokens_per_microbatch
        self.flops = cluster.device_flops
        self.beta = bubble_factor(schedule, self.v)
        self.boundary_bytes = 2.0 * self.tokens * spec.hidden  # bf16 activation / gradient at a stage edge
        self.layer_params = spec.params_per_layer()
        self.emb_params = spec.embedding_params()
        self._caps: dict[tuple[StageKey, bool, bool, float], int] = {}
        self.profiles: dict[tuple[StageKey, ...], object] = {}  # planner_split.PipeProfile per pipeline

    # --- stage pieces ---------------------------------------------------------------------
    def tp_comm_s(self, k: int) -> float:
        """Per layer per micro-batch: 2 forward + 2 backward ring all-reduces inside a node."""
        if k <= 1:
            return 0.0
        c = self.cluster
        ring = 2.0 * (k - 1) / k * self.boundary_bytes / c.intra_node_bw_Bps + 2.0 * (k - 1) * c.intra_node_latency_s
        return 4.0 * ring

    def per_layer_s(self, k: int, speed: float) -> float:
        return self.layer_flops / (k * speed * self.flops) + self.tp_comm_s(k)

    def extra_s(self, k: int, speed: float, first: bool, last: bool) -> float:
        work = (self.first_flops if first else 0.0) + (self.last_flops if last else 0.0)
        return work / (k * speed * self.flops)

    def hops_s(self, p: int) -> float:
        """Activations forward and gradients backward across the p − 1 stage edges."""
        c = self.cluster
        return 2.0 * (p - 1) * (c.inter_node_latency_s + self.boundary_bytes / c.inter_node_bw_Bps)

    def layer_cap(self, key: StageKey, first: bool, last: bool, inflight: float) -> int:
        ck = (key, first, last, inflight)
        hit = self._caps.get(ck)
        if hit is None:
            k, _, mem = key
            hit = max_layers_fitting(
                self.spec, self.config.memory, capacity_bytes=mem, tp=k, first=first, last=last,
                inflight=inflight, tokens=self.tokens,
            )
            self._caps[ck] = hit
        return hit

    def stage_bytes(self, k: int, layers: int, first: bool, last: bool, inflight: float) -> float:
        return stage_device_bytes(
            self.spec, self.config.memory, layers=layers, tp=k, first=first, last=last,
            inflight=inflight, tokens=self.tokens,
        )

    # --- one pipeline -------------------------------------------------------------------
    def inflight(self, p: int, s: int, m: int) -> float:
        return inflight_microbatches(self.schedule, p, s, max(m, 1), self.v)

    def pipeline_time(self, sig: PipeSig, layers: Sequence[int], m: int) -> float:
        """Closed-form time of a pipeline with a given split (layers per device); inf if a
        stage exceeds its memory."""
        if m <= 0:
            return 0.0
        p = len(sig.stages)
        times = []
        for s, (k, sp, mem) in enumerate(sig.stages):
            first, last = s == 0, s == p - 1
            if self.stage_bytes(k, layers[s], first, last, self.inflight(p, s, m)) > mem:
                return INF
            times.append(self.extra_s(k, sp, first, last) + layers[s] * self.per_layer_s(k, sp))
        return (m - 1) * max(times) + self.beta * sum(times) + self.hops_s(p)

    # --- whole iteration ---------------------------------------------------------------
    def sync_s(self, dp: int, shards: Sequence[tuple[int, int, bool, bool, float]]) -> float:
        """DP gradient all-reduce (ring, inter-node) of the largest shard + the optimizer step
        of the slowest shard. ``shards``: (k, layers, first, last, speed) of every stage."""
        c = self.cluster
        worst_params = 0.0
        worst_opt = 0.0
        for k, layers, first, last, speed in shards:
            params = (layers * self.layer_params + (self.emb_params if first else 0) + (self.emb_params if last else 0)) / k
            worst_params = max(worst_params, params)
            worst_opt = max(worst_opt, params / speed)
        opt = worst_opt * self.config.memory.state_bytes_per_param * 2.0 / self.config.hbm_bw_Bps
        if dp <= 1:
            return opt
        ring = 2.0 * (dp - 1) / dp * worst_params * self.config.grad_reduce_bytes / c.inter_node_bw_Bps
        return ring + 2.0 * (dp - 1) * c.inter_node_latency_s + opt


def pipe_sig(speed: dict[int, float], mem: dict[int, float], stages: Sequence[Sequence[int]]) -> PipeSig:
    return PipeSig(tuple((len(g), min(speed[r] for r in g), min(mem[r] for r in g)) for g in stages))


@dataclass(frozen=True)
class Evaluation:
    iteration_s: float  # inf when infeasible
    tokens_per_s: float
    replica_s: tuple[float, ...]
    sync_s: float
    problems: tuple[str, ...]  # why the plan cannot run as is (empty when it can)

    @property
    def feasible(self) -> bool:
        return not self.problems


def plan_problems(plan: Plan, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, config: PlannerConfig) -> list[str]:
    """Everything that stops ``plan`` from running on ``cluster``: unknown or failed ranks,
    illegal or cross-node TP groups, wrong layer counts, wrong share sum, memory overflow."""
    out: list[str] = []
    devs = cluster.by_rank()
    unknown = [r for r in plan.ranks() if r not in devs]
    if unknown:
        return [f"ranks {unknown} are not in the cluster"]
    dead = [r for r in plan.ranks() if devs[r].failed]
    if dead:
        out.append(f"ranks {dead} have failed")
    try:
        plan.validate_for(spec.num_layers, spec.num_heads)
    except SpecError as exc:
        out.append(str(exc))
    for i, rep in enumerate(plan.replicas):
        for s, g in enumerate(rep.stages):
            if len({str(devs[r].node) for r in g}) > 1:
                out.append(f"replica {i} stage {s}: TP group {list(g)} spans nodes")
    if plan.global_microbatches != batch.microbatches:
        out.append(f"micro-batch shares sum to {plan.global_microbatches}, the global batch has {batch.microbatches}")
    if out:
        return out
    costs = Costs(cluster, spec, batch, config, plan.schedule, plan.virtual_chunks)
    for i, rep in enumerate(plan.replicas):
        per_dev = device_layers(rep.layers, rep.pp)
        for s, g in enumerate(rep.stages):
            need = costs.stage_bytes(len(g), per_dev[s], s == 0, s == rep.pp - 1,
                                     costs.inflight(rep.pp, s, rep.microbatches))
            mem = min(devs[r].memory_bytes for r in g)
            if need > mem:
                out.append(
                    f"replica {i} stage {s}: needs {need / 2**30:.1f} GiB per device, has {mem / 2**30:.1f} GiB"
                )
    return out


def device_layers(virtual_layers: Sequence[int], pp: int) -> list[int]:
    """Layers per device from layers per virtual stage (virtual j runs on device j % pp)."""
    out = [0] * pp
    for j, n in enumerate(virtual_layers):
        out[j % pp] += n
    return out


def evaluate(plan: Plan, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, config: PlannerConfig) -> Evaluation:
    """The one scoring function: closed-form iteration time and tokens/s of ``plan``."""
    problems = plan_problems(plan, cluster, spec, batch, config)
    if problems:
        return Evaluation(INF, 0.0, (), INF, tuple(problems))
    costs = Costs(cluster, spec, batch, config, plan.schedule, plan.virtual_chunks)
    return evaluate_with(costs, plan)


def evaluate_with(costs: Costs, plan: Plan) -> Evaluation:
    """``evaluate`` for a plan already known to be legal (no failed ranks, legal TP)."""
    devs = costs.cluster.by_rank()
    speed = {r: d.speed for r, d in devs.items()}
    mem = {r: float(d.memory_bytes) for r, d in devs.items()}
    rep_s: list[float] = []
    shards: list[tuple[int, int, bool, bool, float]] = []
    for rep in plan.replicas:
        sig = pipe_sig(speed, mem, rep.stages)
        per_dev = device_layers(rep.layers, rep.pp)
        rep_s.append(costs.pipeline_time(sig, per_dev, rep.microbatches))
        for s, g in enumerate(rep.stages):
            shards.append((len(g), per_dev[s], s == 0, s == rep.pp - 1, sig.stages[s][1]))
    sync = costs.sync_s(plan.dp, shards)
    it = max(rep_s) + sync
    if it == INF:
        return Evaluation(INF, 0.0, tuple(rep_s), sync, ("a stage exceeds its device memory",))
    tps = costs.batch.microbatches * costs.tokens / it
    return Evaluation(it, tps, tuple(rep_s), sync, ())
