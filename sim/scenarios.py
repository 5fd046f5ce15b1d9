"""Named scenarios: the paper's accelerated ones at 256 GPUs and realistic ones from the
published failure statistics at 1,024–16,384 GPUs.

A scenario fixes the failure process; the job (model, GPUs, layout) comes from
``job_for``. Paper layouts (ResiHP's testbed: 32 nodes × 8 A100) use the model shapes the
paper evaluated, up to TP4 PP16 DP4; larger jobs keep TP8 within a node and PP16 for the
70B-class models (Llama 3's 405B used TP8 PP16 too).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from resihp.coordinator.model.spec import SpecError, preset
from resihp.sim.failures import fail_slows, fail_stops, load_trace
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Settings
from resihp.sim.world import Fault, World

MINUTE = 60.0
HOUR = 3600.0

# (tp, pp) per model for paper-scale jobs; dp follows from the GPU count
PAPER_SHAPES: dict[str, tuple[int, int]] = {
    "llama2-7b": (2, 8),
    "llama2-13b": (4, 8),
    "llama2-70b": (4, 16),
    "qwen2.5-72b": (4, 16),
    "qwen2.5-7b": (2, 8),
    "gpt-tiny": (1, 2),
}
LARGE_SHAPES: dict[str, tuple[int, int]] = {
    "llama2-7b": (2, 8),
    "llama2-13b": (4, 8),
    "llama2-70b": (8, 16),
    "qwen2.5-72b": (8, 16),
    "qwen2.5-7b": (2, 8),
    "gpt-tiny": (1, 2),
}


def global_microbatches(gpus: int) -> int:
    """Global batch in 8K-token micro-batches: 2M tokens up to 512 GPUs, then 1K tokens per
    GPU (16M tokens at 16,384 GPUs, Llama 3's batch)."""
    return max(256, gpus // 8)


def job_for(model: str, gpus: int, *, layout: str = "tuned", tokens_per_microbatch: int = 8192,
            documents: int = 1) -> JobSpec:
    """The job layout used for ``model`` on ``gpus`` GPUs.

    ``layout="tuned"`` (the default for comparisons) picks, among uniform layouts with whole
    nodes per pipeline (what every baseline can run), the fastest one that fits in memory
    under the simulator's cost model — a well-tuned job, so that no policy gains merely by
    leaving a poor initial layout. ``layout="paper"`` uses the paper's shapes as given
    (PAPER_SHAPES / LARGE_SHAPES). ``documents``: packed documents of a typical
    micro-batch, equal in length (1: one document fills it); they set the attention term
    and how finely a document share can cut the global batch.
    """
    if documents < 1 or documents > tokens_per_microbatch:
        raise SpecError(f"documents must be in 1..{tokens_per_microbatch}, got {documents}")
    if documents > 1:
        seqlens = (tokens_per_microbatch // documents,) * documents
        return replace(job_for(model, gpus, layout=layout, tokens_per_microbatch=tokens_per_microbatch),
                       seqlens=seqlens)
    spec = preset(model)
    m_total = global_microbatches(gpus)
    if layout == "paper":
        shapes = PAPER_SHAPES if gpus <= 512 else LARGE_SHAPES
        tp, pp = shapes.get(model, (4, 8))
        if gpus % (tp * pp):
            raise SpecError(f"{gpus} GPUs do not divide into TP{tp} × PP{pp} replicas of {model}; use a multiple of {tp * pp}")
        return JobSpec(spec, tp, pp, gpus // (tp * pp), microbatches=m_total, tokens_per_microbatch=tokens_per_microbatch)
    if layout != "tuned":
        raise SpecError(f"unknown layout {layout!r}; expected 'tuned' or 'paper'")
    return _tuned(model, gpus, tokens_per_microbatch)


@lru_cache(maxsize=64)
def _tuned(model: str, gpus: int, tokens_per_microbatch: int) -> JobSpec:
    spec = preset(model)
    m_total = global_microbatches(gpus)
    best: tuple[float, JobSpec] | None = None
    per_node = 8
    for tp in (1, 2, 4, 8):
        if spec.num_heads % tp:
            continue
        for pp in (1, 2, 4, 8, 16, 32):
            unit = tp * pp
            if unit % per_node or gpus % unit or pp > spec.num_layers:
                continue
            dp = gpus // unit
            if m_total % dp or m_total // dp < 1:
                continue
            job = JobSpec(spec, tp, pp, dp, microbatches=m_total, tokens_per_microbatch=tokens_per_microbatch)
            perf = PerfModel(job)
            plan = job.initial_plan()
            if not perf.replica_fits(plan.replicas[0], plan.schedule):
                continue
            tps = perf.tokens_per_s(plan, World(job.world_size, job.gpus_per_node))
            if best is None or tps > best[0] * 1.0001:
                best = (tps, job)
    if best is None:
        raise SpecError(f"no uniform layout of {model} fits on {gpus} GPUs with whole nodes per pipeline")
    return best[1]


FaultMaker = Callable[[np.random.Generator, JobSpec, float], list[Fault]]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: FaultMaker
    default_hours: float
    default_gpus: int
    paper: bool = False
    settings: Settings = Settings()

    def make(self, job: JobSpec, hours: float, seed: int) -> list[Fault]:
        return self.faults(np.random.default_rng(seed), job, hours * HOUR)


def _stops(every_s: float | None = None, repair_scale: float = 1.0) -> FaultMaker:
    def make(rng: np.random.Generator, job: JobSpec, horizon: float) -> list[Fault]:
        return list(fail_stops(rng, job.world_size, job.gpus_per_node, horizon, every_s=every_s,
                               repair_scale=repair_scale))
    return make


def _slows(every_s: float | None = None, duration_scale: float = 1.0, paper: bool = False) -> FaultMaker:
    def make(rng: np.random.Generator, job: JobSpec, horizon: float) -> list[Fault]:
        if paper:  # the paper's injected magnitudes, half compute, half network
            return list(fail_slows(rng, job.world_size, job.gpus_per_node, horizon, every_s=every_s,
                                   duration_scale=duration_scale, compute_share=0.5, compute_range=(1.5, 4.0),
                                   comm_range=(1.5, 6.0)))
        return list(fail_slows(rng, job.world_size, job.gpus_per_node, horizon, every_s=every_s,
                               duration_scale=duration_scale))
    return make


def _both(a: FaultMaker, b: FaultMaker) -> FaultMaker:
    def make(rng: np.random.Generator, job: JobSpec, horizon: float) -> list[Fault]:
        r1, r2 = (np.random.default_rng(s) for s in rng.integers(0, 2**32, size=2))
        return a(r1, job, horizon) + b(r2, job, horizon)
    return make


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "paper-failstop", "a fail-stop every 30 min (Llama 3 cause mix), as in the paper's fail-stop runs",
            _stops(every_s=30 * MINUTE, repair_scale=0.25), 12.0, 256, paper=True,
        ),
        Scenario(
            "paper-failslow",
            "a fail-slow every 30 min (Greyhound kind mix and durations; 1.5–4× compute, 1.5–6× network)",
            _slows(every_s=30 * MINUTE, paper=True), 12.0, 256, paper=True,
        ),
        Scenario(
            "paper-mixed", "both: a fail-stop and a fail-slow every 30 min each",
            _both(_stops(every_s=30 * MINUTE, repair_scale=0.25), _slows(every_s=30 * MINUTE, paper=True)), 12.0, 256, paper=True,
        ),
        Scenario(
            "paper-mixed-harsh",
            "the harshest mix: a fail-stop every 15 min, a fail-slow every 10 min lasting twice as long",
            _both(_stops(every_s=15 * MINUTE, repair_scale=0.25), _slows(every_s=10 * MINUTE, duration_scale=2.0, paper=True)),
            12.0, 256, paper=True,
        ),
        Scenario(
            "llama3", "realistic: Llama 3 fail-stop rates and Greyhound fail-slow rates",
            _both(_stops(), _slows()), 24.0, 16384, settings=Settings(restart_s=900.0),
        ),
        Scenario("llama3-failstop", "realistic: Llama 3 fail-stops only", _stops(), 24.0, 16384,
                 settings=Settings(restart_s=900.0)),
        Scenario("greyhound-failslow", "realistic: Greyhound fail-slows only", _slows(), 24.0, 16384,
                 settings=Settings(restart_s=900.0)),
    )
}


def scenario_from_file(path: str) -> Scenario:
    """A scenario replaying a failure trace file (docs/failure-trace-format.md)."""
    def make(rng: np.random.Generator, job: JobSpec, horizon: float) -> list[Fault]:
        return [f for f in load_trace(path, job.world_size, job.gpus_per_node) if f.time_s < horizon]
    return Scenario(f"file:{path}", f"replay of {path}", make, 24.0, 256)


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise SpecError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)} (or give a failure-trace file)") from None


def settings_for(scenario: Scenario, gpus: int) -> Settings:
    """Restarts take longer on bigger jobs (more processes, more checkpoint to load)."""
    s = scenario.settings
    if gpus > 512 and s.restart_s < 900.0:
        s = replace(s, restart_s=900.0)
    return s
