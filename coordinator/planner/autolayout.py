"""The initial layout of a job: the healthy TP × PP × DP candidates, ordered by the planner's
prediction, and the choice among them once each has been timed on the job's own devices.

``resihp launch --layout auto`` (and ``hooks.init`` given ``AutoLayout``) times a few
iterations of each candidate before training starts (trainer_hooks/runtime/autolayout.py)
and picks with ``choose``. Why measure rather than trust the prediction: before the job has
run, the planner's profile (device FLOP/s, link speeds) is a configuration, not a measurement
(coordinator/planner/profile.py learns it from healthy iterations later), and its cost model
gives every rank a device of its own. With the CPU demo's profile it priced a TP4 layout at
0.81× of a DP layout's time on 8 ranks sharing 2 cores, where it ran 3.7× of it. On a
cluster the prediction orders the candidates and bounds how many are timed; the measurement
decides.

Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError

# a layout with data parallelism (DP ≥ 2) holds every parameter twice: a dead rank's state
# comes back from its replica with no checkpoint. It is preferred while it is at most this
# much slower than the fastest layout measured.
REPLICA_MARGIN = 0.05


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    dp: int

    def describe(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"

    def plan(self, num_layers: int, global_microbatches: int) -> Plan:
        return Plan.uniform(self.tp, self.pp, self.dp, num_layers, global_microbatches)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``TP2xPP2xDP2`` (``describe``'s spelling; case and spaces do not matter)."""
        found = re.fullmatch(r"TP(\d+)XPP(\d+)XDP(\d+)", text.replace(" ", "").upper())
        if found is None or min(int(g) for g in found.groups()) < 1:
            raise SpecError(f"layout {text!r}: expected TPaxPPbxDPc with a, b, c >= 1, e.g. TP2xPP2xDP2")
        return cls(*(int(g) for g in found.groups()))


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(limit, 1).bit_length()) if (1 << i) <= limit]


def healthy_layouts(model: ModelSpec, world: int, ranks_per_node: int, global_microbatches: int) -> list[Layout]:
    """Every uniform layout of ``world`` ranks that can train ``model``: TP a power of two that
    divides the heads (and KV heads) inside one node, at most one stage per layer, and at least
    one micro-batch per replica. Raises SpecError when there is none."""
    if world < 1 or ranks_per_node < 1 or global_microbatches < 1:
        raise SpecError(f"layouts: need world >= 1, ranks_per_node >= 1, microbatches >= 1; got {world}, "
                        f"{ranks_per_node}, {global_microbatches}")
    kv = model.num_kv_heads or model.num_heads
    out = []
    for tp in _powers_of_two(min(ranks_per_node, world)):
        if model.num_heads % tp or kv % tp or world % tp:
            continue
        for pp in range(1, min(model.num_layers, world // tp) + 1):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if dp <= global_microbatches:
                out.append(Layout(tp, pp, dp))
    if not out:
        raise SpecError(f"no layout of {world} ranks ({ranks_per_node} per node) can train {model.name} "
                        f"({model.num_layers} layers, {model.num_heads} heads) with {global_microbatches} "
                        f"micro-batches per step: give more micro-batches or another number of ranks")
    return out


def predicted_order(layouts: Sequence[Layout], model: ModelSpec, cluster: Cluster,
                    batch: GlobalBatch) -> list[tuple[Layout, float]]:
    """The layouts with the planner's schedule-simulated iteration time, fastest first (ties:
    more DP first, then the smaller TP)."""
    from resihp.coordinator.planner.planner import simulate_plan

    priced = []
    for lay in layouts:
        try:
            seconds = simulate_plan(lay.plan(model.num_layers, batch.microbatches), cluster, model, batch).iteration_s
        except SpecError:
            continue  # does not fit the devices' memory: not a candidate
        priced.append((lay, seconds))
    return sorted(priced, key=lambda p: (p[1], -p[0].dp, p[0].tp, p[0].pp))


@dataclass(frozen=True)
class LayoutChoice:
    layout: Layout
    seconds: float
    reason: str


def choose(measured: Mapping[Layout, float | None], margin: float = REPLICA_MARGIN) -> LayoutChoice:
    """The fastest measured layout; a layout with DP ≥ 2 instead while it is within ``margin``
    of it (its replica is a dead rank's recovery source). ``None`` or a non-finite time: the
    candidate was not timed (cut short or failed)."""
    timed = {lay: s for lay, s in measured.items() if s is not None and math.isfinite(s) and s > 0}
    if not timed:
        raise SpecError("layouts: no candidate layout could be timed")
    fastest = min(timed, key=lambda lay: (timed[lay], -lay.dp, lay.tp))
    best = timed[fastest]
    why = f"{fastest.describe()} ran {best:.4f} s per iteration, the fastest of {len(timed)} timed"
    if fastest.dp < 2:
        replicated = [lay for lay in timed if lay.dp >= 2 and timed[lay] <= best * (1.0 + margin)]
        if replicated:
            pick = min(replicated, key=lambda lay: (timed[lay], -lay.dp))
            return LayoutChoice(pick, timed[pick], f"{pick.describe()} ran {timed[pick]:.4f} s per iteration, within "
                                                   f"{margin:.0%} of {why}, and keeps a data-parallel replica of "
                                                   f"every parameter")
    return LayoutChoice(fastest, best, why)
