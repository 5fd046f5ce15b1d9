"""Ground-truth timing of simulated iterations (see ``sim.workload`` for the why).

Each op of a TP group is timed per member (its own kernels), the group's op lasts as long as
its slowest member (TP collectives inside the layer make the others wait), and the
pipeline schedule places the group ops. Everything is vectorised over a replica's ops and
TP members so a 4,096-rank iteration takes well under a second to generate.
"""
from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.evidence import BWD, FWD, IterationTimings, PlanIndex
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ChunkTiming, IterationRecord
from resihp.sim.workload import BatchStream, WorkloadConfig

FloatArray = npt.NDArray[np.float64]



def path_peer(plan: Plan, rank: int) -> int:
    """The other end of a ``path`` fault on ``rank``: the member of the same TP index in the
    next pipeline stage of its replica (the previous one for a last stage)."""
    pos = plan.position(rank)
    stages = plan.replicas[pos.replica].stages
    if len(stages) < 2:
        raise ValueError(f"a path fault needs a pipeline: rank {rank}'s replica has one stage")
    other = pos.stage + 1 if pos.stage + 1 < len(stages) else pos.stage - 1
    return stages[other][pos.tp_index]

class GroundTruth:
    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.plan = cfg.plan
        hw = cfg.hardware
        self.index = PlanIndex(cfg.plan, {r: f"n{r // hw.gpus_per_node}" for r in cfg.plan.ranks()})
        self.rng = np.random.default_rng(cfg.seed + 7919)
        self.stream = BatchStream(cfg.budget, cfg.packing, seed=cfg.seed, lengths=cfg.documents)
        ix = self.index
        n = ix.n
        ranks = np.asarray(ix.ranks)
        self.node = ranks // hw.gpus_per_node
        self.eff = np.exp(self.rng.normal(0.0, cfg.noise.device_spread, n))
        self.drift_phase = self.rng.uniform(0, 2 * math.pi, n)
        self.drift_period = self.rng.uniform(40, 200, n)
        self.last_time_s = 1.0
        self.last_stall_s = 0.0
        # co-tenant episodes, per node: (end iteration, mean slowdown); own stream, so turning
        # them on leaves every other draw of a seeded run as it was
        self._cotenant_rng = np.random.default_rng(cfg.seed + 104729)
        self._cotenant: dict[int, tuple[int, float]] = {}
        spec = cfg.model
        kv = spec.kv_heads * spec.head_dim
        self.lin_flops_tok = 2.0 * (2 * spec.hidden * spec.hidden + 2 * spec.hidden * kv
                                    + (3 if spec.gated_mlp else 2) * spec.hidden * spec.ffn_hidden)
        self.head_flops_tok = 2.0 * spec.hidden * spec.vocab
        self.layer_params = spec.params_per_layer()
        # per (rank position): members of its TP group as dense indices
        self.members: dict[tuple[int, int], np.ndarray] = {}
        for d, rep in enumerate(self.plan.replicas):
            for s, g in enumerate(rep.stages):
                self.members[(d, s)] = np.array([ix.pos[r] for r in g], dtype=np.int64)
        # per replica: the TP members running each op of its schedule, [ops, tp]
        self.op_members: dict[int, np.ndarray] = {}
        for d, rep in enumerate(self.plan.replicas):
            if rep.microbatches:
                dev = ix.program_gather(ix.rep_program[d])[1]
                self.op_members[d] = np.stack([self.members[(d, int(s))] for s in dev])
        # static: DP rings (stage, TP index) and per-rank optimizer work
        self.dp_groups: dict[int, np.ndarray] = {
            int(g): np.nonzero(ix.ring == g)[0] for g in np.unique(ix.ring)}  # PlanIndex's DP rings
        stage_layers = {
            (d, s): sum(hi - lo for j, (lo, hi) in enumerate(rep.layer_ranges()) if j % rep.pp == s)
            for d, rep in enumerate(self.plan.replicas) for s in range(rep.pp)
        }
        self.layers_of = np.array([stage_layers[(int(ix.rep[i]), int(ix.stage[i]))] for i in range(ix.n)],
                                  dtype=np.float64)

    # --- fault state ------------------------------------------------------------------
    def _slow(self, it: int) -> tuple[FloatArray, FloatArray, dict[tuple[int, int], float]]:
        """Per rank (index position): compute and NIC slowdowns; per pair of positions (the
        lower first): the slowdown of the path between them."""
        comp = np.ones(self.index.n)
        link = np.ones(self.index.n)
        paths: dict[tuple[int, int], float] = {}
        for f in self.cfg.faults:
            if f.kind != "stop" and f.active(it):
                i = self.index.pos[f.rank]
                if f.kind == "compute":
                    comp[i] *= f.factor
                elif f.kind == "link":
                    link[i] *= f.factor
                else:
                    j = self.index.pos[path_peer(self.plan, f.rank)]
                    key = (min(i, j), max(i, j))
                    paths[key] = paths.get(key, 1.0) * f.factor
        return comp, link, paths

    def _host_load(self, it: int) -> tuple[FloatArray, FloatArray]:
        """(mean slowdown, extra per-op jitter sigma) of every rank from co-tenant episodes."""
        nz, rng = self.cfg.noise, self._cotenant_rng
        slow, jit = np.ones(self.index.n), np.zeros(self.index.n)
        if nz.cotenant_prob <= 0:
            return slow, jit
        for node in np.unique(self.node).tolist():
            end, _ = self._cotenant.get(node, (-1, 1.0))
            if it >= end and rng.random() < nz.cotenant_prob:
                lo, hi = nz.cotenant_iters
                self._cotenant[node] = (it + int(rng.integers(lo, hi + 1)),
                                        1.0 + float(rng.uniform(0.0, 2.0 * nz.cotenant_slowdown)))
        for node, (end, factor) in self._cotenant.items():
            if it < end:
                on = self.node == node
                slow[on] = factor
                jit[on] = nz.cotenant_jitter
        return slow, jit

    # --- compute cost of one op (TP shard, at speed 1) -----------------------------------
    def _base(self, rep_idx: int, seqlens: tuple[tuple[int, ...], ...]) -> FloatArray:
        """base[j, k, m]: seconds of kind k (F, B, W) of virtual stage j on micro-batch m."""
        hw = self.cfg.hardware
        rep = self.plan.replicas[rep_idx]
        n_virtual = rep.pp * self.plan.virtual_chunks
        m = len(seqlens)
        tok = np.array([sum(mb) for mb in seqlens], dtype=np.float64)
        ndoc = np.array([len(mb) for mb in seqlens], dtype=np.float64)
        tiles = np.array([sum(math.ceil(x / hw.tile) * (math.ceil(x / hw.tile) + 1) // 2 for x in mb)
                          for mb in seqlens], dtype=np.float64) * hw.tile * hw.tile
        gemm_eff = tok / (tok + 384.0)  # small GEMMs run below peak
        out = np.zeros((n_virtual, 3, m))
        split = self.index.split_backward
        for j, (lo, hi) in enumerate(rep.layer_ranges()):
            layers = hi - lo
            tp = len(rep.stages[j % rep.pp])
            h = self.cfg.model.hidden / tp
            lin = self.lin_flops_tok / tp * tok / (hw.gemm_flops * gemm_eff)
            attn = 4.0 * h * tiles / hw.attn_flops
            over = hw.launch_s + hw.doc_s * ndoc
            f = layers * (lin + attn + over)
            b_in = layers * (lin + 2.5 * attn + 1.5 * over)
            w = layers * (lin + 0.5 * over)
            if j == n_virtual - 1:  # LM head and loss
                head = self.head_flops_tok / tp * tok / (hw.gemm_flops * gemm_eff)
                f = f + head + 2e-4
                b_in = b_in + head
                w = w + head
            if j == 0:  # embedding lookup: memory bound
                f = f + tok * self.cfg.model.hidden * 2 / hw.hbm_Bps
                w = w + tok * self.cfg.model.hidden * 4 / hw.hbm_Bps
            out[j, 0] = f
            out[j, 1] = b_in if split else b_in + w
            out[j, 2] = w if split else 0.0
        return out

    def _hop_s(self, src: np.ndarray, dst: np.ndarray, tokens: FloatArray, tp: int) -> FloatArray:
        hw = self.cfg.hardware
        bw = np.where(self.node[src] == self.node[dst], hw.intra_node_Bps, hw.inter_node_Bps)
        return hw.latency_s + tokens * self.cfg.model.hidden * 2.0 / tp / bw

    def _comm_noise(self, shape: tuple[int, ...]) -> FloatArray:
        nz = self.cfg.noise
        x = np.exp(self.rng.normal(0.0, nz.comm_jitter, shape))
        spike = self.rng.random(shape) < nz.comm_spike_prob
        return np.where(spike, x * self.rng.uniform(1.05, nz.comm_spike_max, shape), x)

    # --- one iteration --------------------------------------------------------------------
    def timings(self, it: int, start_s: float) -> IterationTimings:
        cfg, ix, nz, rng = self.cfg, self.index, self.cfg.noise, self.rng
        n, V, M = ix.n, ix.V, ix.M
        seqlens = tuple(tuple(self.stream.take(rep.microbatches)) for rep in self.plan.replicas)
        comp_slow, link_slow, paths = self._slow(it)
        host_slow, host_jitter = self._host_load(it)
        speed = self.eff * (1.0 + nz.drift * np.sin(2 * math.pi * it / self.drift_period + self.drift_phase))
        compute = np.full((n, V, 3, M), np.nan)
        p2p = np.full((n, V, 2, M), np.nan)
        gc = rng.random(n) < nz.gc_prob
        pipe_end = 0.0
        stalled = 0.0
        spans: list[tuple[int, FloatArray, FloatArray]] = []
        batches: dict[tuple[int, int], list[tuple[int, FloatArray, FloatArray, FloatArray]]] = {}
        for d, rep in enumerate(self.plan.replicas):
            if rep.microbatches == 0:
                continue
            prog, dev, kind, mb, vstage = ix.program_gather(ix.rep_program[d])
            base = self._base(d, seqlens[d])[vstage, kind, mb]  # [ops]
            tp = len(rep.stages[0])
            mem = self.op_members[d]  # [ops, tp]; equal TP sizes
            jitter = np.exp(rng.normal(0.0, nz.op_jitter, mem.shape))
            if host_jitter.any():  # a co-tenant's node: slower and less even
                jitter = jitter * host_slow[mem] * np.exp(
                    self._cotenant_rng.normal(0.0, 1.0, mem.shape) * host_jitter[mem])
            hiccup = rng.random(mem.shape) < nz.os_noise_prob
            jitter = np.where(hiccup, jitter * rng.uniform(1.02, 1.0 + nz.os_noise_max, mem.shape), jitter)
            busy = base[:, None] * jitter * comp_slow[mem] / speed[mem]
            group = busy.max(axis=1)
            # inbound transfers: member t of the sending group to member t of ours
            hop_op = np.zeros(prog.num_ops)
            hop_mem = np.zeros(mem.shape)
            has_hop = np.asarray(prog.hop)
            if has_hop.any():
                dep = np.asarray(prog.dep)
                src = mem[np.where(has_hop, dep, 0)]
                tok = np.array([sum(x) for x in seqlens[d]], dtype=np.float64)[mb]
                t = self._hop_s(src, mem, tok[:, None], tp) * self._comm_noise(mem.shape)
                # a slow NIC slows only the transfers that leave or enter its node
                cross = self.node[src] != self.node[mem]
                t = t * np.where(cross, np.maximum(link_slow[src], link_slow[mem]), 1.0)
                for (a, b), factor in paths.items():  # a slow path between two stages: both ways
                    t = t * np.where(((src == a) & (mem == b)) | ((src == b) & (mem == a)), factor, 1.0)
                hop_mem = np.where(has_hop[:, None], t, 0.0)
                hop_op = hop_mem.max(axis=1)
            delay = np.zeros(prog.num_ops)
            for i in np.nonzero(gc & (ix.rep == d))[0]:  # a GC pause delays one op of that rank's group
                ops_of = np.nonzero((mem == i).any(axis=1))[0]
                op = int(rng.choice(ops_of))
                delay[op] = max(delay[op], rng.uniform(*nz.gc_pause_s))
            if rng.random() < nz.loader_prob:
                delay[int(np.argmin(prog.prev))] += rng.uniform(*nz.loader_pause_s)
            stalled = max(stalled, float(delay.sum()))
            batches.setdefault(ix.rep_program[d], []).append((d, group, hop_op, delay))
            chunk = vstage // rep.pp
            dirs = np.where(kind == 0, FWD, BWD)
            for t_i in range(tp):
                rows = mem[:, t_i]
                compute[rows, chunk, kind, mb] = busy[:, t_i]
                p2p[rows[has_hop], chunk[has_hop], dirs[has_hop], mb[has_hop]] = hop_mem[has_hop, t_i]
        # place every replica that runs the same schedule in one vectorised pass
        for shape, items in batches.items():
            prog = ix.programs[shape]
            start, end = prog.evaluate(np.stack([x[1] for x in items]), np.stack([x[2] for x in items]),
                                       np.stack([x[3] for x in items]))
            for row, (d, _, _, _) in enumerate(items):
                spans.append((d, start[row], end[row]))
            pipe_end = max(pipe_end, float(end.max()))
        spans.sort(key=lambda x: x[0])
        # gradient all-reduce per DP group, then the optimizer step
        dp = np.zeros(n)
        if self.plan.dp > 1:
            hw = cfg.hardware
            for mem_a in self.dp_groups.values():
                first = int(mem_a[0])
                nbytes = 2.0 * self.layers_of[first] * self.layer_params / int(ix.tp_size[first])
                k = len(mem_a)
                cross = len(set(self.node[mem_a].tolist())) > 1
                bw = hw.inter_node_Bps if cross else hw.intra_node_Bps
                t = 2 * (k - 1) * hw.latency_s + 2 * (k - 1) / k * nbytes / bw
                slow = float(link_slow[mem_a].max()) if cross else 1.0
                dp[mem_a] = t * float(self._comm_noise((1,))[0]) * slow
        opt = self.layers_of * self.layer_params / ix.tp_size * 16.0 / cfg.hardware.hbm_Bps
        opt = opt * np.exp(rng.normal(0.0, nz.op_jitter, n)) * comp_slow / speed
        # each rank enters its ring's all-reduce at its own pipeline end; the transfer starts
        # when the ring's last member arrives (without dp_skew_wait: everyone at the global end)
        own_end = np.full(n, pipe_end)
        if nz.dp_skew_wait:
            for d, _, end in spans:
                dev = ix.program_gather(ix.rep_program[d])[1]
                for s_idx, g in enumerate(self.plan.replicas[d].stages):
                    mine = end[dev == s_idx]
                    if len(mine):
                        own_end[[ix.pos[r] for r in g]] = float(mine.max())
        ring_start = np.zeros(n)
        for mem_a in self.dp_groups.values():
            ring_start[mem_a] = own_end[mem_a].max()
        ring_end = ring_start + dp
        for mem_a in self.dp_groups.values():
            ring_end[mem_a] = ring_end[mem_a].max()  # the collective ends together for its members
        end_all = ring_end + opt
        time_s = float(end_all.max())
        if nz.checkpoint_every and it > 0 and it % nz.checkpoint_every == 0:
            pause = float(rng.uniform(*nz.checkpoint_s))
            time_s += pause
            stalled += pause
        self.last_time_s = time_s
        # seconds of GC, data-loader and checkpoint pauses in the iteration (the longest replica's):
        # no cost model predicts them; the benchmark tells the predictor's error without them
        self.last_stall_s = stalled
        self._spans = spans
        self._pipe_end = pipe_end
        self._dp_start, self._dp_end = own_end, ring_end
        out = IterationTimings(it, start_s, time_s, seqlens)
        if cfg.evidence == "chunks":
            # the DP span as timed: from this rank's entry to the ring's end (wait included)
            out.compute, out.p2p, out.opt = compute, p2p, opt
            if self.plan.dp > 1:
                out.dp, out.dp_start = ring_end - own_end, own_end
        elif cfg.evidence == "rank_step":
            # busy time without waits (docs/trace-format.md: rank_step_s), so the DP transfer only
            step = np.nansum(compute, axis=(1, 2, 3)) + np.nansum(p2p, axis=(1, 2, 3)) + dp + opt
            out.rank_step = step
        return out

    def iteration(self, it: int, start_s: float) -> IterationRecord:
        return to_record(self.timings(it, start_s), self)


def to_record(t: IterationTimings, truth: GroundTruth) -> IterationRecord:
    """The trace record of a generated iteration (chunks laid out by the schedule)."""
    ix = truth.index
    chunks: list[ChunkTiming] = []
    if t.compute is not None and t.p2p is not None:
        ranks = ix.ranks
        names = ("F", "B", "W")
        for d, start, end in truth._spans:
            rep = truth.plan.replicas[d]
            prog, dev, kind, mb, vstage = ix.program_gather(ix.rep_program[d])
            for o in range(prog.num_ops):
                s_idx, k, m, j = int(dev[o]), int(kind[o]), int(mb[o]), int(vstage[o])
                v = j // rep.pp
                st = float(start[o])
                for r in rep.stages[s_idx]:
                    i = ix.pos[r]
                    if prog.hop[o]:
                        h = float(t.p2p[i, v, FWD if k == 0 else BWD, m])
                        ready = float(end[prog.dep[o]])
                        chunks.append(ChunkTiming(r, "P2P", m, v, ready, ready + h))
                    chunks.append(ChunkTiming(r, names[k], m, v, st, st + float(t.compute[i, v, k, m])))
        for i, r in enumerate(ranks):
            begin, done = float(truth._dp_start[i]), float(truth._dp_end[i])
            if t.dp is not None:
                chunks.append(ChunkTiming(r, "DP", -1, 0, begin, done))
            if t.opt is not None:
                chunks.append(ChunkTiming(r, "OPT", -1, 0, done, done + float(t.opt[i])))
    steps = {} if t.rank_step is None else {r: float(t.rank_step[i]) for i, r in enumerate(ix.ranks)}
    return IterationRecord(t.iteration, t.start_s, t.time_s, t.seqlens, tuple(chunks), steps)
