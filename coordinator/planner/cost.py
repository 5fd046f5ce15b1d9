"""How fast a layout runs: stage times, the best layer split of a pipeline, and the one
evaluation function every plan (searched, exhaustive, current) is scored with.

Stage time for one micro-batch on a TP group of k devices whose slowest member has speed p:

    t = (layers · layer_flops + extras) / (k · p · device_flops) + layers · tp_comm(k)

with FLOPs from the cost model (``costmodel.layer_flops`` etc., F+B+W) and tp_comm the four
ring all-reduces per layer of Megatron TP inside a node. A pipeline of stages t_s running m
micro-batches takes Oobleck's closed form ``Σ t_s·β + (m − 1)·max t_s``, each t_s holding the
stage's blocking p2p sends of one micro-batch,
β = 1 for 1F1B, 1/v for interleaved 1F1B, 1/3 for ZB-H1 (the bubble shrinks with them).
An iteration is the slowest replica + the DP gradient all-reduce + the optimizer step.
Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import chain

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.costmodel import embedding_flops, head_flops, layer_flops
from resihp.coordinator.model.memory import MemoryModel, inflight_microbatches, max_layers_fitting, stage_device_bytes
from resihp.coordinator.model.plan import PipelinePlan, Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.tables import ClusterTables as ClusterTables  # re-exported
from resihp.coordinator.planner.tables import PipeSig as PipeSig
from resihp.coordinator.planner.tables import StageKey as StageKey
from resihp.coordinator.planner.tables import cluster_tables as cluster_tables
from resihp.coordinator.planner.tables import pipe_sig as pipe_sig

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
    # fail-slow durations are log-normal with these means and shape sigma (Greyhound: heavy
    # tail, hours); the horizon of a fault already ``age`` seconds old is its mean residual
    # life E[T - age | T > age], which *grows* with age. sigma = 0: fixed durations.
    fault_sigma: float = 1.2
    # a transient fault's re-plan is undone when it ends: charge that second move too
    # (its cost times this weight) before acting on a fail-slow
    revert_weight: float = 1.0
    # after a recovery, how long the restored layout is expected to be kept (until the next fault)
    recovery_horizon_s: float = 3600.0
    reshare_latency_s: float = 0.5  # change only the data-loader shares
    regroup_latency_s: float = 10.0  # rebuild communicators and restart the pipeline
    equal_speed_tolerance: float = 0.005  # plans within 0.5 % count as equally fast
    min_gain_fraction: float = 0.01  # gains below 1 % of the iteration are noise
    # for a runtime that all-reduces a layer's gradient shards across replicas shard by shard,
    # which needs every replica to split a layer (and the embedding / head) over one TP size;
    # resihp's sums by coarse shard (trainer_hooks/runtime/trainer.py, Runtime._sync_mixed)
    uniform_tp_per_layer: bool = False
    # DP shares cut by the packed document, not the micro-batch (docs/plan-inputs.md,
    # "Document shares"); the runtime's data path draws token shares (trainer_hooks/runtime/docsplit.py).
    # A batch with one document per micro-batch (no seqlens) keeps whole shares either way
    document_shares: bool = True
    # the largest micro-batch a document share may pack, in tokens (the activation budget:
    # stage memory is checked at it too); 0 = the batch's tokens_per_microbatch
    max_microbatch_tokens: int = 0
    # a re-plan of a job whose layers all have a replica (dp >= 2) keeps at least two: a
    # replica is what a fail-stop recovers from without a checkpoint, so a faster plan with
    # one is taken only where no plan with two fits (docs/plan-inputs.md)
    keep_replicas: bool = True

    def __post_init__(self) -> None:
        for name in (
            "grad_reduce_bytes", "hbm_bw_Bps", "fault_compute_s", "fault_communication_s", "fault_unknown_s",
            "reshare_latency_s", "regroup_latency_s", "equal_speed_tolerance", "min_gain_fraction",
            "fault_sigma", "revert_weight", "recovery_horizon_s",
        ):
            if getattr(self, name) < 0:
                raise SpecError(f"planner config: {name} must be >= 0, got {getattr(self, name)}")
        if self.max_tp < 0:
            raise SpecError(f"planner config: max_tp must be >= 0, got {self.max_tp}")
        if self.max_microbatch_tokens < 0:
            raise SpecError(f"planner config: max_microbatch_tokens must be >= 0, got {self.max_microbatch_tokens}")


@dataclass(frozen=True)
class _Memos:
    caps: dict[tuple[StageKey, bool, bool, float], int]
    inflight: dict[tuple[int, int, int], float]
    bytes: dict[tuple[int, int, bool, bool, float], float]
    pipe_t: dict[tuple[PipeSig, tuple[int, ...], int, float, float], float]
    profiles: dict[tuple[StageKey, ...], object]


_MEMOS: dict[tuple[object, ...], _Memos] = {}


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
        self._tables: tuple[dict[int, float], dict[int, float], dict[int, float]] | None = None
        self._tab = cluster_tables(cluster)
        self._sigs: dict[tuple[tuple[int, ...], ...], PipeSig] = self._tab.sigs
        # the memos below depend on no rank: every Costs of the same model, batch, config,
        # schedule and link constants shares them (a day of decisions meets a few of those)
        key = (spec, batch, config, schedule, self.v, cluster.intra_node_bw_Bps, cluster.inter_node_bw_Bps,
               cluster.intra_node_latency_s, cluster.inter_node_latency_s, cluster.device_flops)
        memos = _MEMOS.get(key)
        if memos is None or len(memos.pipe_t) > 500_000:
            if len(_MEMOS) >= 16:
                _MEMOS.clear()
            memos = _MEMOS[key] = _Memos({}, {}, {}, {}, {})
        self._caps = memos.caps
        self._inflight = memos.inflight
        self._bytes = memos.bytes
        self._pipe_t = memos.pipe_t
        self.profiles = memos.profiles  # planner.split.PipeProfile per pipeline

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
        """A stage's per-micro-batch time besides its layers: the embedding or LM head, and its
        blocking sends — activations forward unless last, gradients back unless first. The
        sends sit on every micro-batch of the stage (as in sim/perf.py), so a bottleneck
        stage's sends stretch the steady state too, not only the fill."""
        work = (self.first_flops if first else 0.0) + (self.last_flops if last else 0.0)
        sends = (0 if first else 1) + (0 if last else 1)
        return work / (k * speed * self.flops) + sends * self.hop_s()

    def hop_s(self) -> float:
        """One stage edge, one direction: a micro-batch's activations (or their gradients)."""
        c = self.cluster
        return c.inter_node_latency_s + self.boundary_bytes / c.inter_node_bw_Bps

    def hops_s(self, p: int) -> float:
        """Activations forward and gradients backward across the p − 1 stage edges, once."""
        return 2.0 * (p - 1) * self.hop_s()

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
        key = (k, layers, first, last, inflight)
        hit = self._bytes.get(key)
        if hit is None:  # identical stages of many replicas share one computation
            hit = self._bytes[key] = stage_device_bytes(
                self.spec, self.config.memory, layers=layers, tp=k, first=first, last=last,
                inflight=inflight, tokens=self.tokens,
            )
        return hit

    def tables(self) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(speed, memory, link factor != 1) per rank, built once per Costs."""
        if self._tables is None:  # shared by every Costs of this cluster object: read-only
            tab = cluster_tables(self.cluster)
            self._tables = (tab.speed, tab.memory, tab.slow_links)
        return self._tables

    def sig(self, stages: tuple[tuple[int, ...], ...]) -> PipeSig:
        """``pipe_sig`` of these stages on this cluster, memoised per cluster object."""
        return self._tab.sig(stages)

    # --- one pipeline -------------------------------------------------------------------
    def inflight(self, p: int, s: int, m: int) -> float:
        key = (p, s, m)
        hit = self._inflight.get(key)
        if hit is None:  # asked for every stage of every candidate shape: memoised
            hit = self._inflight[key] = inflight_microbatches(self.schedule, p, s, max(m, 1), self.v)
        return hit

    def pipeline_time(self, sig: PipeSig, layers: Sequence[int], m: int, frac: float = 1.0,
                      peak: float | None = None) -> float:
        """Closed-form time of a pipeline with a given split (layers per device); inf if a
        stage exceeds its memory. ``frac``: the micro-batches' mean size as a fraction of the
        batch's (a document share); ``peak``: the largest one's (memory is checked at it;
        default ``frac``). Memoised: thousands of replicas share a few shapes."""
        if m <= 0:
            return 0.0
        peak = frac if peak is None else peak
        key = (sig, tuple(layers), m, frac, peak)
        hit = self._pipe_t.get(key)
        if hit is None:
            hit = self._pipe_t[key] = self._pipeline_time(sig, layers, m, frac, peak)
        return hit

    def _pipeline_time(self, sig: PipeSig, layers: Sequence[int], m: int, frac: float, peak: float) -> float:
        p = len(sig.stages)
        times = []
        for s, (k, sp, mem) in enumerate(sig.stages):
            first, last = s == 0, s == p - 1
            if self.stage_bytes(k, layers[s], first, last, self.inflight(p, s, m) * peak) > mem:
                return INF  # activations scale with the largest micro-batch's tokens
            if frac == 1.0:
                times.append(self.extra_s(k, sp, first, last) + layers[s] * self.per_layer_s(k, sp))
            else:
                times.append(self.stage_s(k, sp, layers[s], first, last, frac))
        return (m - 1) * max(times) + self.beta * sum(times)  # the sends are in extra_s

    def stage_s(self, k: int, speed: float, layers: int, first: bool, last: bool, frac: float) -> float:
        """One stage's time for a micro-batch of ``frac`` of the batch's tokens: compute and
        bytes on the wire scale with the tokens (attention too: the same documents, fewer of
        them), latencies do not."""
        c = self.cluster
        work = layers * self.layer_flops + (self.first_flops if first else 0.0) + (self.last_flops if last else 0.0)
        compute = frac * work / (k * speed * self.flops)
        tp = 0.0
        if k > 1:
            tp = 4.0 * layers * (2.0 * (k - 1) / k * frac * self.boundary_bytes / c.intra_node_bw_Bps
                                 + 2.0 * (k - 1) * c.intra_node_latency_s)
        sends = (0 if first else 1) + (0 if last else 1)
        hop = c.inter_node_latency_s + frac * self.boundary_bytes / c.inter_node_bw_Bps
        return compute + tp + sends * hop

    # --- whole iteration ---------------------------------------------------------------
    def sync_s(self, dp: int, shards: Sequence[tuple[int, int, bool, bool, float]], link: float = 1.0) -> float:
        """DP gradient all-reduce (ring, inter-node) of the largest shard + the optimizer step
        of the slowest shard. ``shards``: (k, layers, first, last, speed) of every stage;
        ``link``: the worst link slowdown factor on the rings (a ring runs at its slowest link)."""
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
        return (ring + 2.0 * (dp - 1) * c.inter_node_latency_s) * link + opt

    def link_extra_s(self, factors: Sequence[float], m: int) -> float:
        """Extra point-to-point time of a pipeline of m micro-batches whose stages have these
        worst link slowdown factors: each stage edge runs at the slower of its two ends, and
        a stage pays its slower sends on every micro-batch. Charged as if the most delayed
        stage set the steady state, ``(m − 1)·max δ_s + β·Σ δ_s`` (exact when the stages were
        balanced, which the split makes them nearly; an upper bound otherwise)."""
        hop = self.hop_s()
        edges = [max(a, b) - 1.0 for a, b in zip(factors, factors[1:])]
        # stage s sends forward over edge s and backward over edge s − 1
        delta = [hop * ((edges[s] if s < len(edges) else 0.0) + (edges[s - 1] if s > 0 else 0.0))
                 for s in range(len(factors))]
        return max(m - 1, 0) * max(delta, default=0.0) + self.beta * sum(delta)


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


def plan_problems(plan: Plan, cluster: Cluster, spec: ModelSpec, batch: GlobalBatch, config: PlannerConfig,
                  excluded: Collection[int] = ()) -> list[str]:
    """Everything that stops ``plan`` from running on ``cluster``: unknown or failed ranks,
    illegal or cross-node TP groups, wrong layer counts, wrong share sum, memory overflow.
    ``excluded``: failed devices that are alive but taken out by the operator (named so)."""
    out: list[str] = []
    tab = cluster_tables(cluster)
    devs = tab.devs
    members = plan._members  # the plan's ranks as the set Plan validated them with
    if not devs.keys() >= members:
        unknown = [r for r in plan.ranks() if r not in devs]
        return [f"ranks {unknown} are not in the cluster"]
    dead = sorted(tab.failed.intersection(members))
    if dead:
        out.append(failed_text(dead, excluded, "are"))
    try:
        plan.validate_for(spec.num_layers, spec.num_heads)
    except SpecError as exc:
        out.append(str(exc))
    node_of = tab.node_of.__getitem__
    one_node = tab.one_node  # groups already seen inside one node (candidates share most groups)
    seen = tab.one_node_ids  # the same tuple objects are checked again and again: by identity
    if len(seen) > 200_000:
        seen.clear()
    for i, rep in enumerate(plan.replicas):
        for s, g in enumerate(rep.stages):
            if seen.get(id(g)) is g:
                continue
            if g in one_node:
                seen[id(g)] = g
                continue
            if len(set(map(node_of, g))) > 1 and len({str(devs[r].node) for r in g}) > 1:
                out.append(f"replica {i} stage {s}: TP group {list(g)} spans nodes")
            else:
                one_node.add(g)
                seen[id(g)] = g
    if plan.document_shares:
        want = batch.microbatches * batch.tokens_per_microbatch
        got = plan.global_tokens(batch.tokens_per_microbatch)
        if got != want:
            out.append(f"token shares sum to {got}, the global batch has {want} tokens")
    elif plan.global_microbatches != batch.microbatches:
        out.append(f"micro-batch shares sum to {plan.global_microbatches}, the global batch has {batch.microbatches}")
    if out:
        return out
    costs = Costs(cluster, spec, batch, config, plan.schedule, plan.virtual_chunks)
    needs: dict[tuple[tuple[int, ...], int, tuple[int, ...], int], list[float]] = {}
    least = tab.least_memory  # a stage needing no more fits anywhere
    for i, rep in enumerate(plan.replicas):
        shape = (rep.layers, rep.microbatches, tuple(map(len, rep.stages)), rep.tokens)
        row = needs.get(shape)
        if row is None:  # identical replicas need identical memory
            per_dev = device_layers(rep.layers, rep.pp)
            peak = share_fractions(rep, batch)[1]  # activations of the largest micro-batch
            row = needs[shape] = [
                costs.stage_bytes(len(g), per_dev[s], s == 0, s == rep.pp - 1,
                                  costs.inflight(rep.pp, s, rep.microbatches) * peak)
                for s, g in enumerate(rep.stages)
            ]
        if max(row) <= least:
            continue
        for s, g in enumerate(rep.stages):
            need = row[s]
            mem = min(devs[r].memory_bytes for r in g)
            if need > mem:
                out.append(
                    f"replica {i} stage {s}: needs {need / 2**30:.1f} GiB per device, has {mem / 2**30:.1f} GiB"
                )
    return out


def share_fractions(rep: PipelinePlan, batch: GlobalBatch) -> tuple[float, float]:
    """(mean, largest) micro-batch of a replica as fractions of the batch's micro-batch.

    A token share packs whole documents: with n documents per typical micro-batch the
    replica holds d = share / (B / n) of them, ``microbatches`` micro-batches of ⌊d/m⌋ or
    ⌈d/m⌉ documents. Time is priced at the mean (documents of varying length let the packer
    even the tokens out), memory at the largest. Whole micro-batches: (1, 1)."""
    if not rep.tokens or rep.microbatches <= 0:
        return 1.0, 1.0
    b = batch.tokens_per_microbatch
    n = batch.documents_per_microbatch
    mean = rep.tokens / (rep.microbatches * b)
    docs = rep.tokens * n / b
    peak = math.ceil(docs / rep.microbatches - 1e-9) / n
    return mean, max(mean, peak)


def failed_text(ranks: Sequence[int], excluded: Collection[int], verb: str = "were") -> str:
    """"ranks [5] have failed", "ranks [3] <verb> excluded by the operator", or both: the
    planner marks both unavailable, but an operator's exclusion is not a fault."""
    out = [r for r in ranks if r in excluded]
    gone = [r for r in ranks if r not in excluded]
    parts = ([f"ranks {gone} have failed"] if gone else []) + ([f"ranks {out} {verb} excluded by the operator"] if out else [])
    return " and ".join(parts)


def largest_shard(costs: Costs, stages: Sequence[StageKey], layers: Sequence[int]) -> float:
    """The largest per-device parameter shard, scaled by its speed, of a pipeline with these
    stage types and layers per stage (ties between splits go to the smaller: the DP
    all-reduce waits for it)."""
    p = len(stages)
    return max(
        (layers[s] * costs.layer_params + (costs.emb_params if s == 0 else 0) + (costs.emb_params if s == p - 1 else 0))
        / (key[0] * key[1])
        for s, key in enumerate(stages)
    )


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
    tab = costs._tab
    slow_links = tab.slow_links
    members = plan._members
    # the odd and link-slow ranks this plan uses (few): without any, every replica is plain
    special = frozenset(r for r in tab.special if r in members)
    rep_s: list[float] = []
    shards: list[tuple[int, int, bool, bool, float]] = []
    seen: set[tuple[PipeSig, tuple[int, ...]]] = set()  # identical replicas add identical shards
    worst_link = 1.0
    for rep in plan.replicas:
        # a replica of top-speed devices on healthy links (most of them): its signature
        # follows from its TP sizes, and no link term applies
        plain = not special or special.isdisjoint(chain.from_iterable(rep.stages))
        sig = tab.plain_sig(tuple(map(len, rep.stages))) if plain else tab.sig(rep.stages)
        per_dev = tuple(rep.layers) if len(rep.layers) == rep.pp else tuple(device_layers(rep.layers, rep.pp))
        frac, peak = share_fractions(rep, costs.batch)
        t = costs.pipeline_time(sig, per_dev, rep.microbatches, frac, peak)
        if not plain and slow_links and not slow_links.keys().isdisjoint(chain.from_iterable(rep.stages)):
            # a communication slowdown stretches this pipeline's p2p, not its compute
            factors = [max(slow_links.get(r, 1.0) for r in g) for g in rep.stages]
            worst_link = max(worst_link, max(factors))
            if rep.microbatches > 0:
                t += costs.link_extra_s(factors, rep.microbatches) * frac
        rep_s.append(t)
        if (sig, per_dev) not in seen:
            seen.add((sig, per_dev))
            p = rep.pp
            for s, g in enumerate(rep.stages):
                shards.append((len(g), per_dev[s], s == 0, s == p - 1, sig.stages[s][1]))
    sync = costs.sync_s(plan.dp, shards, worst_link)
    it = max(rep_s) + sync
    if it == INF:
        return Evaluation(INF, 0.0, tuple(rep_s), sync, ("a stage exceeds its device memory",))
    tps = costs.batch.microbatches * costs.tokens / it
    return Evaluation(it, tps, tuple(rep_s), sync, ())
