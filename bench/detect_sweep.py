"""bench/detect.py's robustness sweep: noise level x fault kind, each cell a few generated runs.

The generator (sim/workload_truth.py) is the same one the main table uses, with its noise
classes turned down (quiet), as measured on GPUs (realistic) or up (noisy: per-op jitter 4 %,
lognormal P2P jitter 30 %, frequent GC pauses and data-loader stalls, congestion spikes, a
wider spread between devices, co-tenant episodes on the hosts). Every DP span holds the wait for its ring's last arriver
(``Noise.dp_skew_wait``). Fault kinds: compute slowdowns of 1.1x, 1.25x and 2x on any rank
(first and last stages included), a 2x slow NIC, a transient 1.5x slowdown of 5-50
iterations, a fail-stop as an exit, as a hang (no exit, heartbeats stop) and stuck (heartbeats go on, the rank
stuck inside an op, its peers waiting in p2p and collective ops), and two faults
at once. Plans cycle through 1F1B, interleaved and ZB-H1 layouts with TP 2-8 and PP 4.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.sim.workload import Fault, Noise, WorkloadConfig

NOISE = {
    "quiet": Noise.quiet(),
    "realistic": Noise.everything(),
    "noisy": Noise(op_jitter=0.04, device_spread=0.02, drift=0.01, os_noise_prob=0.01, gc_prob=0.1,
                   loader_prob=0.1, comm_jitter=0.3, comm_spike_prob=0.05, comm_spike_max=2.0, cotenant_prob=0.05),
}
KINDS = ("healthy", "compute-1.1x", "compute-1.25x", "compute-2x", "link-2x", "transient", "stop-exit", "hang",
         "stuck", "two-at-once")
START = 30  # the iteration faults start at (after warm-up)


@dataclass
class Cell:
    noise: str
    kind: str
    runs: int = 0
    false_alarms: int = 0
    faults: int = 0
    found: int = 0
    latencies: list[int] = field(default_factory=list)
    exact: int = 0


def _faults(kind: str, plan: Plan, j: int) -> tuple[Fault, ...]:
    ranks = plan.ranks()
    # any rank: the first stage, the last stage, and the middle in turn
    rank = (ranks[0], ranks[-1], ranks[len(ranks) // 2 + 1])[j % 3]
    if kind == "healthy":
        return ()
    if kind.startswith("compute-"):
        return (Fault("compute", rank, START, float(kind.split("-")[1].rstrip("x"))),)
    if kind == "link-2x":
        return (Fault("link", rank, START, 2.0),)
    if kind == "transient":
        return (Fault("compute", rank, START, 1.5, START + (5, 20, 50)[j % 3]),)
    if kind == "stop-exit":
        return (Fault("stop", rank, START, exit_event=True),)
    if kind == "hang":
        return (Fault("stop", rank, START, exit_event=False),)
    if kind == "stuck":
        return (Fault("stop", rank, START, exit_event=False, stuck=True),)
    other = ranks[(ranks.index(rank) + len(ranks) // 2) % len(ranks)]
    return (Fault("compute", rank, START, 2.0), Fault("link", other, START + 3, 3.0))


def configs(model: ModelSpec, plans: dict[str, Plan], runs_per_cell: int) -> list[tuple[str, str, WorkloadConfig]]:
    """(noise level, fault kind, run config) for every run of the sweep."""
    names = sorted(plans)
    out = []
    for n_i, (noise_name, noise) in enumerate(NOISE.items()):
        for k_i, kind in enumerate(KINDS):
            for j in range(runs_per_cell):
                plan_name = names[(k_i + j) % len(names)]
                plan = plans[plan_name]
                link = kind in ("link-2x", "two-at-once")
                hw_kw: dict[str, Any] = {}
                if link:  # a NIC matters only across nodes: two GPUs per node
                    from resihp.sim.workload import Hardware
                    hw_kw["hardware"] = Hardware(gpus_per_node=2)
                cfg = WorkloadConfig(model, plan, budget=(8192, 16384, 32768)[j % 3], packing=("best-fit", "greedy")[j % 2],
                                     seed=1000 + 97 * n_i + 13 * k_i + j, iterations=60 if kind not in ("hang", "stuck") else 45,
                                     noise=dataclasses.replace(noise), faults=_faults(kind, plan, j),
                                     heartbeats=kind in ("stop-exit", "hang", "stuck"), **hw_kw)
                out.append((noise_name, kind, cfg))
    return out


def score(cells: dict[tuple[str, str], Cell], noise: str, kind: str, faults: Sequence[Fault],
          findings: Sequence[Any], iterations: int) -> None:
    cell = cells.setdefault((noise, kind), Cell(noise, kind))
    cell.runs += 1
    used: set[int] = set()
    for f in faults:
        cell.faults += 1
        want = ("fail-stop",) if f.kind == "stop" else ("fail-slow", "degraded")
        end = (f.end_iter if f.end_iter is not None else iterations) + 2
        hit = next((i for i, x in enumerate(findings) if i not in used and x.kind in want
                    and f.start_iter - 1 <= x.iteration <= end and f.rank in x.ranks), None)
        if hit is None:
            continue
        used.add(hit)
        x = findings[hit]
        cell.found += 1
        cell.latencies.append(max(0, x.iteration - f.start_iter + 1))
        cause = {"compute": "compute", "link": "communication"}.get(f.kind, x.cause)
        cell.exact += int(tuple(x.ranks) == (f.rank,) and x.cause == cause)
    cell.false_alarms += sum(1 for i, x in enumerate(findings) if i not in used and x.kind not in ("recovered",))


def table(cells: dict[tuple[str, str], Cell], print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Print the sweep; return its worst cells."""
    print_fn(f"{'noise':<10}{'fault':<15}{'runs':>5}{'FA/run':>8}{'recall':>8}{'p95 lat':>8}{'loc':>6}")
    worst_fa = ("every cell", 0.0)  # named cells only where one is worse than the goal's best
    worst_recall = ("every cell", 1.0)
    for (noise, kind), c in sorted(cells.items(), key=lambda kv: (list(NOISE).index(kv[0][0]), KINDS.index(kv[0][1]))):
        fa = c.false_alarms / c.runs if c.runs else 0.0
        recall = c.found / c.faults if c.faults else float("nan")
        p95 = float(np.percentile(c.latencies, 95)) if c.latencies else float("nan")
        loc = c.exact / c.found if c.found else float("nan")
        print_fn(f"{noise:<10}{kind:<15}{c.runs:>5}{fa:>8.2f}{recall:>8.2f}{p95:>8.1f}{loc:>6.2f}")
        if fa > worst_fa[1]:
            worst_fa = (f"{noise}/{kind}", fa)
        if c.faults and recall < worst_recall[1]:
            worst_recall = (f"{noise}/{kind}", recall)
    return {"sweep_worst_false_alarms": {"cell": worst_fa[0], "per_run": round(worst_fa[1], 3)},
            "sweep_worst_recall": {"cell": worst_recall[0], "recall": round(worst_recall[1], 3)}}
