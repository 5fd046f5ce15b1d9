"""Iteration time of a plan on the simulated hardware: the one performance oracle every
policy is judged by.

Stage compute comes from the real cost model (``resihp.coordinator.model.costmodel.stage_flops``)
divided by the device's sustained FLOP/s and its current speed (a TP group runs at its
slowest member). Each stage also pays its tensor-parallel all-reduces (2 forward, 2
backward per layer, ring over the group's links: 2(tp−1) latencies each) and the point-to-point send of its
activations (forward) or gradients (backward) to the neighbour stage, slowed by the worse
of the two nodes' network factors. Pipeline makespan under 1F1B is Oobleck's closed form
for unequal stages from ``resihp.coordinator.schedule.simulator`` (other schedules run the schedule
simulator); the iteration is the slowest replica plus the data-parallel gradient
all-reduce (ring across replicas, slowed by the slowest NIC taking part) plus, when the job
describes it (``optimizer_bytes_per_param`` > 0), the memory-bound optimizer step of the
largest shard. Activations and gradients are ``activation_bytes_per_value`` wide (bf16: 2).

``overlap_p2p=True`` models a runtime that takes send/recv off the compute stream (Adaptra's
CPU-side RDMA): a stage then costs max(compute, p2p) instead of their sum.

Results are cached per replica shape and speeds, so a 16,384-GPU job with a few sick
devices costs a handful of distinct evaluations. Pure.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from resihp.coordinator.model import costmodel
from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.memory import MemoryModel, inflight_microbatches, stage_device_bytes
from resihp.coordinator.model.plan import PipelinePlan, Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.sim.world import World

GiB = 2**30


@dataclass(frozen=True)
class JobSpec:
    """A training job: model, initial layout, global batch and hardware."""

    model: ModelSpec
    tp: int
    pp: int
    dp: int
    microbatches: int  # global micro-batches per iteration
    tokens_per_microbatch: int = 8192
    seqlens: tuple[int, ...] = ()  # packed documents of a typical micro-batch; () = one document
    gpus_per_node: int = 8
    schedule: Schedule = Schedule.ONE_F_ONE_B
    device_flops: float = 150e12  # sustained bf16 FLOP/s of a healthy A100-class device
    intra_node_bw_Bps: float = 300e9
    inter_node_bw_Bps: float = 25e9
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    memory_bytes: int = 80 * GiB
    grad_bytes_per_param: float = 2.0  # bf16 gradient all-reduce
    activation_bytes_per_value: float = 2.0  # bf16 activations between stages and in TP all-reduces
    # optimizer step: memory-bound, bytes it touches per parameter of the device's shard over
    # the device's memory bandwidth (fp32 AdamW: 28). 0 = not modelled (the default: < 0.2 %
    # of an iteration at cluster scale; it matters for small models, e.g. CPU runs)
    optimizer_bytes_per_param: float = 0.0
    device_mem_bw_Bps: float = 2.0e12
    # host time per forward or backward of a stage's micro-batch outside its compute (the
    # framework's own work: Python, bookkeeping, posting messages). 0 = not modelled (the
    # default: on GPUs it overlaps the device's queue); CPU runs measure it (bench/sim_vs_real.py)
    op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "microbatches", "tokens_per_microbatch", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise SpecError(f"job: {name} must be >= 1, got {getattr(self, name)}")
        if not self.activation_bytes_per_value > 0 or not self.optimizer_bytes_per_param >= 0:
            raise SpecError("job: activation_bytes_per_value must be > 0 and optimizer_bytes_per_param >= 0, got "
                            f"{self.activation_bytes_per_value} and {self.optimizer_bytes_per_param}")
        if not (math.isfinite(self.op_overhead_s) and self.op_overhead_s >= 0):
            raise SpecError(f"job: op_overhead_s must be a finite number >= 0 seconds, got {self.op_overhead_s}")
        if not self.device_mem_bw_Bps > 0:
            raise SpecError(f"job: device_mem_bw_Bps must be > 0, got {self.device_mem_bw_Bps}")
        if self.world_size % self.gpus_per_node:
            raise SpecError(
                f"job: tp×pp×dp = {self.world_size} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes"
            )
        if self.gpus_per_node % self.tp:
            raise SpecError(f"job: tp ({self.tp}) must divide gpus_per_node ({self.gpus_per_node}): TP stays in a node")
        if self.microbatches < self.dp:
            raise SpecError(f"job: {self.microbatches} micro-batches cannot feed {self.dp} replicas")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    @property
    def tokens_per_iteration(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    def typical_seqlens(self) -> tuple[int, ...]:
        return self.seqlens or (self.tokens_per_microbatch,)

    def initial_plan(self) -> Plan:
        """The uniform starting layout; built once per job (plans are immutable values and
        a 16K-rank one is costly to build)."""
        hit = self.__dict__.get("_initial_plan")
        if not isinstance(hit, Plan):
            hit = Plan.uniform(self.tp, self.pp, self.dp, self.model.num_layers, self.microbatches, self.schedule)
            self.__dict__["_initial_plan"] = hit
        return hit

    def batch(self) -> GlobalBatch:
        return GlobalBatch(self.microbatches, self.tokens_per_microbatch, self.seqlens)

    def cluster(self, speeds: dict[int, float] | None = None, failed: Sequence[int] = (),
                links: dict[int, float] | None = None) -> Cluster:
        """The planner's view: every device with the given compute speeds, link slowdown
        factors and failures."""
        speeds = speeds or {}
        links = links or {}
        dead = set(failed)
        healthy = self.__dict__.get("_healthy_devices")
        if not isinstance(healthy, tuple):  # built once; only the devices that differ are replaced
            healthy = tuple(DeviceState(r, r // self.gpus_per_node, 1.0, False, self.memory_bytes, 1.0)
                            for r in range(self.world_size))
            self.__dict__["_healthy_devices"] = healthy
        changed = sorted(r for r in set(speeds) | set(links) | dead if 0 <= r < self.world_size)
        if changed:
            out = list(healthy)
            for r in changed:
                out[r] = DeviceState(r, r // self.gpus_per_node, speeds.get(r, 1.0), r in dead, self.memory_bytes,
                                     links.get(r, 1.0))
            devs = tuple(out)
        else:
            devs = healthy
        return Cluster(
            devs, self.intra_node_bw_Bps, self.inter_node_bw_Bps, self.intra_node_latency_s,
            self.inter_node_latency_s, self.device_flops,
        )

    def scaled(self, dp: int) -> JobSpec:
        """The same job with ``dp`` replicas and the same micro-batches per replica."""
        return replace(self, dp=dp, microbatches=self.microbatches // self.dp * dp)


@dataclass(frozen=True)
class StageCost:
    f_s: float  # forward of one micro-batch incl. TP comm and activation send
    b_s: float  # whole backward (B + W) incl. TP comm and gradient send


@dataclass
class PerfModel:
    """Evaluates plans of one job on a World. ``iteration_s`` is the truth the engine uses."""

    job: JobSpec
    memory: MemoryModel = field(default_factory=MemoryModel)
    _cache: dict[tuple[object, ...], object] = field(default_factory=dict, repr=False)
    _plans: dict[int, _PlanInfo] = field(default_factory=dict, repr=False)

    # --- per-stage costs ------------------------------------------------------------------
    def _flops(self, layers: int, tp: int, first: bool, last: bool) -> costmodel.ChunkFlops:
        return _stage_flops_cached(self.job.model, self.job.typical_seqlens(), layers, tp, first, last)

    def stage_cost(
        self, layers: int, tp: int, first: bool, last: bool, speed: float,
        p2p_factor: float, cross_node_p2p: bool, overlap_p2p: bool = False, frac: float = 1.0,
    ) -> StageCost:
        """One micro-batch of ``frac`` of the job's micro-batch tokens (a document share packs
        the same kind of documents, fewer of them: FLOPs and bytes scale, latencies do not)."""
        job = self.job
        fl = self._flops(layers, tp, first, last)
        if frac != 1.0:
            fl = fl.scale(frac)
        rate = job.device_flops * speed
        act_bytes = job.activation_bytes_per_value * job.tokens_per_microbatch * job.model.hidden * frac
        # TP: 2 all-reduces of the activations forward and 2 backward per layer; a ring takes
        # 2(tp-1) steps, each paying the link latency (as the DP all-reduce and the planner's model)
        tp_comm = 0.0
        if tp > 1:
            tp_comm = 2.0 * layers * (2.0 * (tp - 1) / tp * act_bytes / job.intra_node_bw_Bps
                                      + 2.0 * (tp - 1) * job.intra_node_latency_s)
        if cross_node_p2p:
            p2p = act_bytes / job.inter_node_bw_Bps * p2p_factor + job.inter_node_latency_s
        else:
            p2p = act_bytes / job.intra_node_bw_Bps + job.intra_node_latency_s
        if last:
            p2p_f = 0.0  # the last stage sends nothing forward
        else:
            p2p_f = p2p
        p2p_b = 0.0 if first else p2p
        f = fl.f / rate + tp_comm + job.op_overhead_s
        b = (fl.b + fl.w) / rate + tp_comm + job.op_overhead_s
        if overlap_p2p:
            return StageCost(max(f, p2p_f), max(b, p2p_b))
        return StageCost(f + p2p_f, b + p2p_b)

    def _info(self, plan: Plan) -> _PlanInfo:
        hit = self._plans.get(id(plan))
        if hit is not None and hit.plan is plan:
            return hit
        if len(self._plans) > 512:
            self._plans.clear()
        info = _PlanInfo.build(plan, self.job)
        self._plans[id(plan)] = info
        return info

    def replica_stage_costs(self, plan: Plan, replica: int, world: World, overlap_p2p: bool = False) -> list[StageCost]:
        if plan.virtual_chunks != 1:
            raise SpecError("sim perf model: interleaved plans (virtual_chunks > 1) are not modelled")
        info = self._info(plan)
        bad_ranks, bad_nodes = world.faulty()
        touched = not info.ranks[replica].isdisjoint(bad_ranks) or not info.nodes[replica].isdisjoint(bad_nodes)
        frac = self.share_fraction(plan.replicas[replica])
        if not touched:  # the common case: every healthy replica of a shape costs the same
            key: tuple[object, ...] = ("healthy", info.sigs[replica], overlap_p2p, frac)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._stage_costs(plan.replicas[replica], info.stage_nodes[replica], None, overlap_p2p, frac=frac)
                self._cache[key] = hit
            return hit  # type: ignore[return-value]
        return self._stage_costs(plan.replicas[replica], info.stage_nodes[replica], world, overlap_p2p, replica, frac)

    def share_fraction(self, rep: PipelinePlan) -> float:
        """A replica's mean micro-batch as a fraction of the job's (1 for whole micro-batches)."""
        if not rep.tokens or rep.microbatches <= 0:
            return 1.0
        return rep.tokens / (rep.microbatches * self.job.tokens_per_microbatch)

    def _stage_costs(
        self, rep: PipelinePlan, nodes: list[frozenset[int]], world: World | None, overlap_p2p: bool, replica: int = 0,
        frac: float = 1.0,
    ) -> list[StageCost]:
        out = []
        for s, group in enumerate(rep.stages):
            speed = 1.0 if world is None else min(world.speed(r) for r in group)
            if speed <= 0.0:
                raise DeadRankError(f"replica {replica} stage {s} uses a failed device")
            nxt = nodes[s + 1] if s + 1 < rep.pp else nodes[s]
            prev = nodes[s - 1] if s > 0 else nodes[s]
            cross = bool(nodes[s] ^ nxt) or bool(nodes[s] ^ prev) or len(nodes[s]) > 1
            p2p_factor = 1.0 if world is None else max(world.net_factor(n) for n in nodes[s] | nxt | prev)
            out.append(
                self.stage_cost(rep.layers[s], len(group), s == 0, s == rep.pp - 1, speed, p2p_factor, cross, overlap_p2p,
                                frac)
            )
        return out

    # --- pipeline and iteration -------------------------------------------------------------
    def pipeline_s(self, costs: Sequence[StageCost], microbatches: int) -> float:
        if microbatches <= 0:
            return 0.0
        key: tuple[object, ...] = ("pipe", tuple((c.f_s, c.b_s) for c in costs), microbatches, self.job.schedule)
        hit = self._cache.get(key)
        if not isinstance(hit, float):
            hit = pipeline_makespan([c.f_s for c in costs], [c.b_s for c in costs], microbatches, self.job.schedule)
            self._cache[key] = hit
        return hit

    def dp_sync_s(self, plan: Plan, world: World) -> float:
        info = self._info(plan)
        d = info.active
        if d <= 1:
            return 0.0
        _, bad_nodes = world.faulty()
        factor = max((world.net_factor(n) for n in bad_nodes & info.all_nodes), default=1.0)
        return (2.0 * (d - 1) / d * info.worst_grad_params * self.job.grad_bytes_per_param / self.job.inter_node_bw_Bps
                * factor + 2 * (d - 1) * self.job.inter_node_latency_s)

    def optimizer_s(self, plan: Plan) -> float:
        """The optimizer step after the DP sync: every device steps its own shard at once,
        so the iteration waits for the largest one."""
        if self.job.optimizer_bytes_per_param <= 0.0:
            return 0.0
        return self._info(plan).worst_grad_params * self.job.optimizer_bytes_per_param / self.job.device_mem_bw_Bps

    def replica_s(self, plan: Plan, replica: int, world: World, overlap_p2p: bool = False) -> float:
        rep = plan.replicas[replica]
        if rep.microbatches == 0:
            return 0.0
        return self.pipeline_s(self.replica_stage_costs(plan, replica, world, overlap_p2p), rep.microbatches)

    def iteration_s(self, plan: Plan, world: World, overlap_p2p: bool = False) -> float:
        """Seconds per iteration; inf when the plan needs a failed device."""
        key = ("iter", id(self._info(plan)), world.fingerprint(), overlap_p2p)
        hit = self._cache.get(key)
        if isinstance(hit, float):
            return hit
        try:
            t = (max(self.replica_s(plan, i, world, overlap_p2p) for i in range(plan.dp)) + self.dp_sync_s(plan, world)
                 + self.optimizer_s(plan))
        except DeadRankError:
            t = math.inf
        if len(self._cache) > 200_000:
            self._cache.clear()
            self._plans.clear()
        self._cache[key] = t
        return t

    def tokens_per_s(self, plan: Plan, world: World, overlap_p2p: bool = False) -> float:
        t = self.iteration_s(plan, world, overlap_p2p)
        if not math.isfinite(t) or t <= 0:
            return 0.0
        return plan.global_tokens(self.job.tokens_per_microbatch) / t

    # --- memory (for the baselines' feasibility checks) -------------------------------------
    def replica_fits(self, rep: PipelinePlan, schedule: Schedule) -> bool:
        for s, group in enumerate(rep.stages):
            need = stage_device_bytes(
                self.job.model, self.memory, layers=rep.layers[s], tp=len(group), first=s == 0, last=s == rep.pp - 1,
                inflight=inflight_microbatches(schedule, rep.pp, s, max(rep.microbatches, rep.pp)),
                tokens=self.job.tokens_per_microbatch,
            )
            if need > self.job.memory_bytes:
                return False
        return True


@dataclass
class _PlanInfo:
    """What evaluating a plan needs besides speeds, computed once per plan object."""

    plan: Plan  # held so that id(plan) stays unique while cached
    sigs: list[tuple[object, ...]]
    ranks: list[frozenset[int]]
    nodes: list[frozenset[int]]
    stage_nodes: list[list[frozenset[int]]]
    all_nodes: frozenset[int]
    active: int
    worst_grad_params: float

    @classmethod
    def build(cls, plan: Plan, job: JobSpec) -> _PlanInfo:
        per = job.gpus_per_node
        sigs: list[tuple[object, ...]] = []
        ranks: list[frozenset[int]] = []
        nodes: list[frozenset[int]] = []
        stage_nodes: list[list[frozenset[int]]] = []
        worst = 0.0
        active_nodes: set[int] = set()
        params_per_layer = job.model.params_per_layer()
        emb = job.model.embedding_params()
        one: dict[int, frozenset[int]] = {}  # node -> {node}, shared by the groups inside it
        for rep in plan.replicas:
            sn = []
            for g in rep.stages:
                nodes_g = {r // per for r in g}
                if len(nodes_g) == 1:
                    (n,) = nodes_g
                    f = one.get(n)
                    if f is None:
                        f = one[n] = frozenset(nodes_g)
                    sn.append(f)
                else:
                    sn.append(frozenset(nodes_g))
            stage_nodes.append(sn)
            rs = frozenset(r for g in rep.stages for r in g)
            ranks.append(rs)
            ns_all = frozenset().union(*sn)
            nodes.append(ns_all)
            # structure up to renaming of nodes: which stage edges cross a node boundary
            cross = tuple(
                (bool(sn[s] ^ sn[s + 1]) if s + 1 < rep.pp else False, len(sn[s]) > 1) for s in range(rep.pp)
            )
            sigs.append((tuple(map(len, rep.stages)), rep.layers, cross))
            if rep.microbatches > 0:
                active_nodes |= ns_all
                for s, group in enumerate(rep.stages):
                    params = rep.layers[s] * params_per_layer
                    if s == 0 or s == rep.pp - 1:
                        params += emb
                    worst = max(worst, params / len(group))
        active = sum(1 for rep in plan.replicas if rep.microbatches > 0)
        return cls(plan, sigs, ranks, nodes, stage_nodes, frozenset(active_nodes), active, worst)


class DeadRankError(RuntimeError):
    """A plan asks a failed device to work."""


@lru_cache(maxsize=4096)
def _stage_flops_cached(
    model: ModelSpec, seqlens: tuple[int, ...], layers: int, tp: int, first: bool, last: bool
) -> costmodel.ChunkFlops:
    return costmodel.stage_flops(model, seqlens, layers, tp, first=first, last=last)


def pipeline_makespan(f: Sequence[float], b: Sequence[float], m: int, schedule: Schedule) -> float:
    """One replica's pipeline time for ``m`` equal micro-batches, from the schedule module:
    the closed form for 1F1B, the dependency-graph simulator for the others."""
    from resihp.coordinator.schedule import simulator as sched

    if schedule is Schedule.ONE_F_ONE_B:
        return float(sched.one_f_one_b_time(list(f), list(b), m))
    pp = len(f)
    if schedule is Schedule.ZB_H1:
        # split the backward evenly into B (input grad) and W (weight grad)
        fs = [[x] * m for x in f]
        bs = [[x / 2.0] * m for x in b]
        res = sched.simulate_pipeline(schedule, fs, bs, bs, pp=pp)
    else:
        res = sched.simulate_pipeline(schedule, [[x] * m for x in f], [[x] * m for x in b], None, pp=pp)
    return float(res.makespan_s)
