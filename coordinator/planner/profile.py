"""The planner's cluster profile, measured from the job's own healthy iterations.

The planner prices a layout from a profile — FLOP/s of a device, bandwidth and latency of
the links, memory bandwidth of the optimizer step (``Cluster``, ``PlannerConfig``). A
configured profile is a guess: on the four-node slow-link run (tests/test_plan_audit_netns.py)
the CPU demo profile priced PP2×DP2 at 0.565 s per iteration when it ran 0.247 s, and chose
a layout that ran 2.6× slower. The detector's link factors and speeds are ratios against
*measured* healthy times, so the base they multiply should be measured too.

``ProfileFitter`` reads the trace records of healthy iterations and inverts the planner's
own cost formulas (coordinator/planner/cost.py), so that the profile is in the planner's units (its
bf16 byte counts included: a runtime that sends fp32 shows half the bandwidth, which
prices every transfer the same):

- ``device_flops``: Σ cost-model FLOPs of the F and B ops (each op's share of
  ``stage_flops`` for its micro-batch's real documents) / Σ their compute time (span minus
  the op's ``TP`` span);
- ``tp_latency_s``: what one ring step of a TP all-reduce costs beyond the configured
  intra-node bandwidth, from the ``TP`` spans (the planner charges 2 all-reduces per layer
  per F or B op, 2(k − 1) ring steps each);
- ``link_bw_Bps`` and ``link_latency_s``: a line ``t = steps·latency + bytes/bandwidth``
  through the P2P spans (1 step, a micro-batch's boundary activations) and the DP spans
  (2(d − 1) steps, 2(d − 1)/d of the rank's gradient shard), in relative least squares; with
  one kind of transfer only, the configured line is scaled to it;
- ``intra_bw_Bps`` and ``intra_latency_s``: the same line through the P2P spans of ranks whose
  pipeline neighbours share their node (given the ranks' nodes), the configured intra-node
  line scaled to it. A job that has run no TP group has measured no TP all-reduce, yet a
  re-plan may form one: without this its price was the configured NVLink-class line. On a
  CPU job over loopback that priced TP2 at 0.079 s per iteration; it ran 0.373 s;
- ``hbm_bw_Bps``: optimizer bytes (``state_bytes_per_param`` × 2 per parameter of the
  shard) over the OPT spans.

Every estimate is the median over a window of per-iteration values, so a stray iteration
cannot move it. Pure (no torch, grpc or MPI), deterministic.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from resihp.coordinator.model.costmodel import stage_flops
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.model.trace import ChunkTiming, IterationRecord, PlanChange, Record

UNBOUNDED_BW = 1e18  # B/s: a link whose time is all latency
MAX_RANKS = 64  # ranks read per iteration: a stride over larger jobs keeps a record's cost bounded


@dataclass(frozen=True)
class Profile:
    """Measured profile fields; None where the job gave no evidence for one."""

    device_flops: float | None = None
    link_bw_Bps: float | None = None
    link_latency_s: float | None = None
    tp_latency_s: float | None = None
    hbm_bw_Bps: float | None = None
    iterations: int = 0  # healthy iterations the estimates come from
    intra_bw_Bps: float | None = None  # P2P inside a node (module docstring)
    intra_latency_s: float | None = None

    def cluster_fields(self) -> dict[str, float]:
        """The ``Cluster`` fields this profile measured (stage edges and DP rings are the
        planner's inter-node links; TP all-reduces its intra-node ones)."""
        out: dict[str, float] = {}
        if self.device_flops is not None:
            out["device_flops"] = self.device_flops
        if self.link_bw_Bps is not None and self.link_latency_s is not None:
            out["inter_node_bw_Bps"] = self.link_bw_Bps
            out["inter_node_latency_s"] = self.link_latency_s
        if self.tp_latency_s is not None:
            out["intra_node_latency_s"] = self.tp_latency_s
        elif self.intra_bw_Bps is not None and self.intra_latency_s is not None:
            # no TP span measured: a TP group's all-reduce is priced on the node's measured links
            out["intra_node_bw_Bps"] = self.intra_bw_Bps
            out["intra_node_latency_s"] = self.intra_latency_s
        return out

    def describe(self) -> str:
        if not self.iterations:
            return "no healthy iteration measured yet"
        parts = []
        if self.device_flops is not None:
            parts.append(f"{self.device_flops / 1e9:.3g} GFLOP/s")
        if self.link_bw_Bps is not None and self.link_latency_s is not None:
            parts.append(f"links {self.link_bw_Bps / 1e6:.3g} MB/s + {self.link_latency_s * 1e6:.0f} µs")
        if self.tp_latency_s is not None:
            parts.append(f"TP step {self.tp_latency_s * 1e6:.0f} µs")
        elif self.intra_bw_Bps is not None and self.intra_latency_s is not None:
            parts.append(f"in-node links {self.intra_bw_Bps / 1e6:.3g} MB/s + {self.intra_latency_s * 1e6:.0f} µs")
        if self.hbm_bw_Bps is not None:
            parts.append(f"optimizer {self.hbm_bw_Bps / 1e9:.3g} GB/s")
        return f"measured over {self.iterations} healthy iterations: " + ", ".join(parts)

    def to_json(self) -> dict[str, float | int | None]:
        return {"device_flops": self.device_flops, "link_bw_Bps": self.link_bw_Bps,
                "link_latency_s": self.link_latency_s, "tp_latency_s": self.tp_latency_s,
                "hbm_bw_Bps": self.hbm_bw_Bps, "iterations": self.iterations,
                "intra_bw_Bps": self.intra_bw_Bps, "intra_latency_s": self.intra_latency_s}


@dataclass(frozen=True)
class _Transfer:
    steps: float  # latency terms (ring steps or one hop)
    bytes: float  # in the planner's units
    time_s: float


class ProfileFitter:
    """Feed it healthy ``IterationRecord``s of the current plan; read ``profile()``."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, intra_node_bw_Bps: float = 300e9,
                 inter_node_bw_Bps: float = 25e9, inter_node_latency_s: float = 20e-6,
                 intra_node_latency_s: float = 5e-6, nodes: Mapping[int, str] | None = None,
                 grad_reduce_bytes: float = 2.0, state_bytes_per_param: float = 16.0, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.spec = spec
        self.intra_bw = intra_node_bw_Bps
        self.configured_link = (inter_node_latency_s, inter_node_bw_Bps)
        self.configured_intra = (intra_node_latency_s, intra_node_bw_Bps)
        self.nodes = dict(nodes or {})  # rank -> node; none known: no in-node line
        self.grad_bytes = grad_reduce_bytes
        self.state_bytes = state_bytes_per_param
        self.boundary_bytes = 0.0
        self._flops: deque[float] = deque(maxlen=window)
        self._tp: deque[float] = deque(maxlen=window)
        self._p2p: deque[_Transfer] = deque(maxlen=window)
        self._p2p_in_node: deque[_Transfer] = deque(maxlen=window)
        self._dp: deque[_Transfer] = deque(maxlen=window)
        self._hbm: deque[float] = deque(maxlen=window)
        self._seen = 0
        self.window = window
        self.set_plan(plan)

    def set_plan(self, plan: Plan) -> None:
        """Samples are in the planner's units, so they stay valid across plans."""
        self.plan = plan
        pos = plan.position_table()
        ranks = sorted(pos)
        stride = max(1, math.ceil(len(ranks) / MAX_RANKS))
        self._ranks = frozenset(ranks[::stride])
        self._pos = pos
        self._in_node = frozenset(r for r in ranks if self._neighbours_in_node(plan, r))

    def _neighbours_in_node(self, plan: Plan, rank: int) -> bool:
        """Every rank of the stages next to ``rank``'s in its pipeline is on its node (and it
        has such a stage): its P2P transfers use only the node's links."""
        node = self.nodes.get(rank)
        if node is None:
            return False
        d, s, _, _ = self._pos[rank]
        stages = plan.replicas[d].stages
        near = [r for j in (s - 1, s + 1) if 0 <= j < len(stages) for r in stages[j]]
        return bool(near) and all(self.nodes.get(r) == node for r in near)

    # --- feeding ------------------------------------------------------------------------
    def add(self, rec: IterationRecord) -> None:
        if not rec.chunks:
            return
        by_rank: dict[int, list[ChunkTiming]] = {}
        for c in rec.chunks:
            if c.rank in self._ranks:
                by_rank.setdefault(c.rank, []).append(c)
        if not by_rank:
            return
        flops = comp = tp_time = tp_steps = tp_bytes = opt_bytes = opt_time = 0.0
        p2p: list[_Transfer] = []
        p2p_in_node: list[_Transfer] = []
        dp: list[_Transfer] = []
        plan = self.plan
        for rank, chunks in by_rank.items():
            d, s, _, k = self._pos[rank]
            rep = plan.replicas[d]
            if d >= len(rec.seqlens):
                continue
            pp, nv = rep.pp, len(rep.layers)
            # a TP span ends where its op ends (one per op at most): F and B told apart so
            tp_of = {(c.microbatch, c.chunk, round(c.end_s, 9)): c.duration_s for c in chunks if c.kind == "TP"}
            whole_backward = not any(c.kind == "W" for c in chunks)  # 1F1B: B is B and W together
            for c in chunks:
                if c.kind in ("F", "B", "W") and 0 <= c.microbatch < len(rec.seqlens[d]):
                    j = c.chunk * pp + s  # virtual stage of this op
                    if j >= nv:
                        continue
                    seq = rec.seqlens[d][c.microbatch]
                    layers = rep.layers[j]
                    f = stage_flops(self.spec, seq, layers, k, first=j == 0, last=j == nv - 1)
                    share = f.f if c.kind == "F" else f.w if c.kind == "W" else f.b + (f.w if whole_backward else 0.0)
                    inside = min(tp_of.get((c.microbatch, c.chunk, round(c.end_s, 9)), 0.0), c.duration_s)
                    if c.duration_s - inside > 0 and share > 0:
                        flops += share
                        comp += c.duration_s - inside
                    if k > 1 and c.kind in ("F", "B"):
                        tokens = float(sum(seq))
                        tp_time += inside
                        tp_steps += 2.0 * layers * 2.0 * (k - 1)
                        tp_bytes += 2.0 * layers * 2.0 * (k - 1) / k * 2.0 * tokens * self.spec.hidden
                elif c.kind == "P2P" and 0 <= c.microbatch < len(rec.seqlens[d]) and c.duration_s > 0:
                    tokens = float(sum(rec.seqlens[d][c.microbatch]))
                    p2p.append(_Transfer(1.0, 2.0 * tokens * self.spec.hidden, c.duration_s))
                    if rank in self._in_node:
                        p2p_in_node.append(p2p[-1])
                elif c.kind in ("DP", "OPT") and c.duration_s > 0:
                    params = self._shard_params(rep.layers, s, pp, k)
                    if c.kind == "OPT":
                        opt_bytes += params * self.state_bytes * 2.0
                        opt_time += c.duration_s
                    elif plan.dp > 1:
                        n = plan.dp
                        dp.append(_Transfer(2.0 * (n - 1), 2.0 * (n - 1) / n * params * self.grad_bytes, c.duration_s))
        self._seen += 1
        if comp > 0:
            self._flops.append(flops / comp)
        if tp_steps > 0 and tp_time > 0:
            self._tp.append(max(0.0, (tp_time - tp_bytes / self.intra_bw) / tp_steps))
        if opt_time > 0:
            self._hbm.append(opt_bytes / opt_time)
        for pool, got in ((self._p2p, p2p), (self._dp, dp), (self._p2p_in_node, p2p_in_node)):
            if got:
                mid = sorted(got, key=lambda x: x.time_s)[len(got) // 2]
                pool.append(mid)

    def _shard_params(self, layers: tuple[int, ...], stage: int, pp: int, k: int) -> float:
        own = [j for j in range(len(layers)) if j % pp == stage]
        n = sum(layers[j] for j in own) * self.spec.params_per_layer()
        n += self.spec.embedding_params() * ((0 in own) + (len(layers) - 1 in own))
        return n / k

    # --- reading ------------------------------------------------------------------------
    def profile(self) -> Profile:
        lat_bw = fit_link(list(self._p2p) + list(self._dp), self.configured_link)
        intra = fit_link(list(self._p2p_in_node), self.configured_intra)
        n = max(len(self._flops), len(self._p2p), len(self._dp), len(self._hbm))
        return Profile(
            device_flops=statistics.median(self._flops) if self._flops else None,
            link_bw_Bps=None if lat_bw is None else lat_bw[1],
            link_latency_s=None if lat_bw is None else lat_bw[0],
            tp_latency_s=statistics.median(self._tp) if self._tp else None,
            hbm_bw_Bps=statistics.median(self._hbm) if self._hbm else None,
            iterations=min(n, self._seen),
            intra_bw_Bps=None if intra is None else intra[1],
            intra_latency_s=None if intra is None else intra[0],
        )


class HealthJudge(Protocol):
    """What ``fit_trace`` needs of a detector (coordinator/detector/detector.py's ``Detector``)."""

    def observe(self, record: Record, now: float) -> Any: ...
    def tick(self, now: float) -> Any: ...
    def all_healthy(self) -> bool: ...


def fit_trace(records: Iterable[Record], judge: HealthJudge, fitter: ProfileFitter) -> int:
    """Replay recorded ``records`` through ``judge`` as the coordinator saw them live, and feed
    ``fitter`` the iterations it judged every rank healthy in; returns how many those were."""
    healthy = 0
    for rec in records:
        now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else float(getattr(rec, "time_s", 0.0))
        judge.observe(rec, now)
        judge.tick(now)
        if isinstance(rec, PlanChange):
            fitter.set_plan(rec.plan)
        elif isinstance(rec, IterationRecord) and judge.all_healthy():
            fitter.add(rec)
            healthy += 1
    return healthy


def fit_link(samples: list[_Transfer], configured: tuple[float, float]) -> tuple[float, float] | None:
    """(latency s, bandwidth B/s) of ``t = steps·latency + bytes/bandwidth`` through the median
    time of every distinct (steps, bytes), in relative least squares with both terms >= 0.
    One distinct point cannot split latency from bandwidth: the configured line is scaled
    to pass through it. None without samples."""
    groups: dict[tuple[float, float], list[float]] = {}
    for s in samples:
        groups.setdefault((s.steps, s.bytes), []).append(s.time_s)
    pts = [(a, x, statistics.median(ts)) for (a, x), ts in sorted(groups.items()) if statistics.median(ts) > 0]
    if not pts:
        return None
    lat0, bw0 = configured
    if len({x / a if a else math.inf for a, x, _ in pts}) < 2:
        scale = statistics.median(t / (a * lat0 + x / bw0) for a, x, t in pts)
        return lat0 * scale, bw0 / scale
    # minimise Σ ((a·L + x·G − t) / t)² over L = latency, G = 1 / bandwidth (normal equations)
    rows = [(a / t, x / t) for a, x, t in pts]
    saa = sum(p * p for p, _ in rows)
    sxx = sum(q * q for _, q in rows)
    sax = sum(p * q for p, q in rows)
    sa1 = sum(p for p, _ in rows)
    sx1 = sum(q for _, q in rows)
    det = saa * sxx - sax * sax
    lat = g = -1.0
    if det > 1e-12 * saa * sxx:
        lat = (sa1 * sxx - sx1 * sax) / det
        g = (saa * sx1 - sax * sa1) / det
    if lat < 0 or g <= 0:  # the line needs a negative term: keep the better one-term fit
        lat_only = (sa1 / saa, UNBOUNDED_BW)
        bw_only = (0.0, sxx / sx1)
        return min((lat_only, bw_only), key=lambda lb: _rel_error(pts, lb[0], 1.0 / lb[1]))
    return lat, 1.0 / g


def _rel_error(pts: list[tuple[float, float, float]], lat: float, g: float) -> float:
    return sum(((a * lat + x * g) - t) ** 2 / (t * t) for a, x, t in pts)


def cluster_overrides(profile: Profile, configured: Mapping[str, float]) -> dict[str, float]:
    """``configured`` Cluster fields with the measured ones in their place."""
    return {**configured, **profile.cluster_fields()}
