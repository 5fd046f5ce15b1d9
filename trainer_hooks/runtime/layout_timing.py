"""The timing half of an automatic layout (runtime/autolayout.py): build each candidate, train
a few throw-away iterations, keep the slowest rank's times, choose."""
from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.autolayout import Layout, LayoutChoice, choose, healthy_layouts, predicted_order
from resihp.trainer_hooks.runtime.autolayout import AutoLayout, ranks_per_node


@dataclass
class Timing:
    layout: Layout
    predicted_s: float
    seconds: list[float]
    cut_short: bool = False

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


def candidates(spec: ModelSpec, world: int, per_node: int, request: AutoLayout, tokens_per_microbatch: int,
               fits: Callable[[Plan], None] | None = None) -> list[tuple[Layout, float]]:
    """The layouts to time, best predicted first: at most ``request.max_candidates``; ``fits``
    raises SpecError for a layout the model cannot take (a user's model's TP limits)."""
    layouts = healthy_layouts(spec, world, per_node, request.microbatches)
    ok = []
    for lay in layouts:
        try:
            plan = lay.plan(spec.num_layers, request.microbatches)
            plan.validate_for(spec.num_layers, spec.num_heads)
            if fits is not None:
                fits(plan)
        except SpecError:
            continue
        ok.append(lay)
    cluster = Cluster.uniform(max(1, world // per_node), per_node)
    batch = GlobalBatch(request.microbatches, tokens_per_microbatch)
    order = predicted_order(ok, spec, cluster, batch)
    if not order:
        raise SpecError(f"no layout of {world} ranks can train {spec.name}: every candidate was refused")
    return order[: request.max_candidates]


def time_layouts(rank: int, spec: ModelSpec, config: Any, request: AutoLayout, order: list[tuple[Layout, float]],
                 device: torch.device, build: Callable[[Plan], Any]) -> list[Timing]:
    """Time each candidate on every rank (collective: all ranks call it with the same order).
    ``build(plan)`` returns the rank's Runtime for ``plan`` (its groups made collectively)."""
    out: list[Timing] = []
    best = math.inf
    for lay, predicted in order:
        plan = lay.plan(spec.num_layers, request.microbatches)
        runtime = build(plan)
        timing = Timing(lay, predicted, [])
        for step in range(request.warmup + request.steps):
            t0 = time.perf_counter()
            runtime.train_step(step)
            # on the runtime's device: an NCCL default group refuses a CPU tensor
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the iteration is its slowest rank's
            if step < request.warmup:
                continue
            timing.seconds.append(float(took.item()))
            if len(timing.seconds) == 1 and timing.seconds[0] > request.cutoff * best and step + 1 < (
                    request.warmup + request.steps):
                timing.cut_short = True
                break
        runtime.let_go_of_groups()
        del runtime
        gc.collect()
        median = timing.median_s
        best = min(best, median if median is not None else math.inf)
        out.append(timing)
    return out


def choice_record(spec: ModelSpec, world: int, request: AutoLayout, timings: list[Timing], chosen: LayoutChoice,
                  took_s: float) -> dict[str, Any]:
    plan = chosen.layout.plan(spec.num_layers, request.microbatches)
    return {
        "plan": plan.to_dict(), "layout": chosen.layout.describe(), "seconds_per_iteration": chosen.seconds,
        "reason": chosen.reason, "model": spec.name, "world": world, "microbatches": request.microbatches,
        "profile_s": round(took_s, 3),
        "candidates": [{"layout": t.layout.describe(), "predicted_s": round(t.predicted_s, 6),
                        "measured_s": [round(s, 6) for s in t.seconds], "cut_short": t.cut_short}
                       for t in timings],
    }


def profile(rank: int, world: int, nodes: tuple[str, ...], spec: ModelSpec, config: Any, request: AutoLayout,
            device: torch.device, build: Callable[[Plan], Any], fits: Callable[[Plan], None] | None = None,
            ) -> tuple[Plan, dict[str, Any]]:
    """Time the candidates and choose (every rank gets the same answer: the times are all-reduced)."""
    t0 = time.perf_counter()
    order = candidates(spec, world, ranks_per_node(nodes, rank), request, config.budget, fits)
    timings = time_layouts(rank, spec, config, request, order, device, build)
    chosen = choose({t.layout: t.median_s for t in timings if not t.cut_short})
    record = choice_record(spec, world, request, timings, chosen, time.perf_counter() - t0)
    return chosen.layout.plan(spec.num_layers, request.microbatches), record


