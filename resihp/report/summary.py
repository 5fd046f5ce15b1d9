"""The summary numbers of a run: throughput per phase, detection latency, downtime, loss.

Phases. The run is cut at every injection and every reconfiguration, in time order: healthy
start | after the fail-slow injection (before adaptation) | after the planned
reconfiguration | after the kill (until recovery) | after the recovery. A step belongs to the
latest boundary it has passed: an injection once the step *ended* after the injection time,
a reconfiguration once the step number reaches the reconfiguration's first step.

Throughput of a phase is Σ tokens / elapsed wall time between step end times inside it:
the steps after the phase's first one, over (end of last − end of first). The gap before
the first step of a phase (the reconfiguration downtime, or the step the fault landed in)
is therefore excluded; downtime is reported on its own, and ``tokens_per_s_overall`` counts
everything from the first to the last step end, downtime included.

Pure: no matplotlib.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resihp.report.data import FindingEvent, Injection, Progress, Reconfig, RunData, StepRow, load_run

FINDING_KIND = {"slow": "fail-slow", "kill": "fail-stop"}


@dataclass(frozen=True)
class Phase:
    key: str  # healthy | fail-slow | adapted | fail-stop | recovered (a -2 suffix on repeats)
    label: str
    start_time_s: float  # since job start: the boundary's time (0 for the first phase)
    steps: tuple[int, ...]
    tokens_per_s: float | None  # None: fewer than two steps
    epoch: int | None
    plan: str


@dataclass(frozen=True)
class Detection:
    kind: str  # slow | kill
    rank: int
    injected_s: float  # since job start
    factor: float
    finding_kind: str | None
    finding_ranks: tuple[int, ...]
    latency_s: float | None  # None: no matching finding after the injection
    latency_iters: int | None  # finding iteration − injected step (slow: the first step that ran slowed)


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    first_step: int
    last_step: int
    reruns: int
    epochs: list[int]
    tokens_total: int
    elapsed_s: float
    tokens_per_s_overall: float | None
    phases: list[Phase]
    detections: list[Detection]
    reconfigs: list[Reconfig]
    findings: int
    injections_from: str
    final_loss: float
    reference_final_loss: float | None  # at loss_compared_at_step
    final_loss_rel_delta: float | None  # |loss − ref| / |ref| at loss_compared_at_step
    loss_compared_at_step: int | None  # the last step both runs trained (the final step unless the reference is shorter)
    loss_delta_vs_reference: float | None  # max relative |loss − ref| / |ref| over common steps
    reference_steps_compared: int
    stopped: str = ""  # why the job stopped early, when its trainer said so
    skipped_lines: dict[str, int] = field(default_factory=dict)
    scenario: dict[str, Any] = field(default_factory=dict)
    audits: dict[int, str] = field(default_factory=dict)  # epoch -> the plan audit's verdict on its switch

    def _latency(self, kind: str, iters: bool = False) -> float | int | None:
        for d in self.detections:
            if d.kind == kind:
                return d.latency_iters if iters else d.latency_s
        return None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for ph, p in zip(out["phases"], self.phases):  # the range, not every step number
            del ph["steps"]
            ph.update(first_step=p.steps[0] if p.steps else None, last_step=p.steps[-1] if p.steps else None,
                      n_steps=len(p.steps))
        out["tokens_per_s"] = {p.key: p.tokens_per_s for p in self.phases}
        out["detect_latency_s_slow"] = self._latency("slow")
        out["detect_latency_iters_slow"] = self._latency("slow", iters=True)
        out["detect_latency_s_stop"] = self._latency("kill")
        out["downtime_s"] = [r.downtime_s for r in self.reconfigs]
        out["bytes_moved"] = [r.bytes_moved for r in self.reconfigs]
        return out


def _tokens_per_s(rows: list[StepRow]) -> float | None:
    if len(rows) < 2 or rows[-1].time <= rows[0].time:
        return None
    return sum(r.tokens for r in rows[1:]) / (rows[-1].time - rows[0].time)


@dataclass(frozen=True)
class _Boundary:
    time: float
    key: str
    label: str
    injection: Injection | None = None
    reconfig: Reconfig | None = None

    def passed(self, row: StepRow) -> bool:
        if self.reconfig is not None:
            return row.step >= self.reconfig.step
        return row.time > self.time


def _boundaries(data: RunData) -> list[_Boundary]:
    out: list[_Boundary] = []
    for inj in data.injections:
        if inj.kind == "slow":
            out.append(_Boundary(inj.time, "fail-slow",
                                 f"after fail-slow x{inj.factor:g} on rank {inj.rank} (before adaptation)", injection=inj))
        else:
            out.append(_Boundary(inj.time, "fail-stop", f"after kill of rank {inj.rank} (until recovery)", injection=inj))
    for rc in data.progress.reconfigs:
        if rc.kind == "fail-stop":
            out.append(_Boundary(rc.time, "recovered", f"after kill + recovery (epoch {rc.epoch})", reconfig=rc))
        else:
            out.append(_Boundary(rc.time, "adapted", f"after {rc.kind} reconfiguration (epoch {rc.epoch})",
                                 reconfig=rc))
    out.sort(key=lambda b: b.time)
    return out


def phases(data: RunData) -> list[Phase]:
    bounds = _boundaries(data)
    members: list[list[StepRow]] = [[] for _ in range(len(bounds) + 1)]
    for row in data.progress.steps:
        idx = 0
        for i, b in enumerate(bounds):
            if b.passed(row):
                idx = i + 1
        members[idx].append(row)
    seen: dict[str, int] = {}
    out: list[Phase] = []
    for i, rows in enumerate(members):
        key, label, start = ("healthy", "healthy start", 0.0) if i == 0 else (
            bounds[i - 1].key, bounds[i - 1].label, bounds[i - 1].time - data.t0)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key = f"{key}-{seen[key]}"
        last = rows[-1] if rows else None
        rc = bounds[i - 1].reconfig if i else None
        plan = last.plan if last else (rc.plan if rc is not None else "")
        out.append(Phase(key, label, start, tuple(r.step for r in rows), _tokens_per_s(rows),
                         last.epoch if last else None, plan))
    return out


def _injected_step(inj: Injection, steps: list[StepRow]) -> int | None:
    if inj.step is not None:
        return inj.step
    after = [r.step for r in steps if r.time > inj.time]
    return min(after) if after else None


def _detection(inj: Injection, findings: list[FindingEvent], steps: list[StepRow], t0: float) -> Detection:
    want = FINDING_KIND[inj.kind]
    # the rank's own finding; a job-level one (no ranks: the trace had no per-rank evidence) also counts
    match = next((f for f in findings if f.kind == want and f.time >= inj.time and (inj.rank in f.ranks or not f.ranks)),
                 None)
    if match is None:
        return Detection(inj.kind, inj.rank, inj.time - t0, inj.factor, None, (), None, None)
    at = _injected_step(inj, steps)
    iters = match.iteration - at if at is not None and match.iteration >= 0 and inj.kind == "slow" else None
    return Detection(inj.kind, inj.rank, inj.time - t0, inj.factor, match.kind, match.ranks, match.time - inj.time,
                     iters)


@dataclass(frozen=True)
class _LossCompare:
    step: int | None = None  # the last step both runs trained (normally the final step)
    reference: float | None = None
    delta: float | None = None  # relative, at ``step``
    max_delta: float | None = None  # relative, over every common step
    common: int = 0


def _loss_vs(progress: Progress, reference: Progress | None) -> _LossCompare:
    if reference is None or not reference.steps:
        return _LossCompare()
    ref = {r.step: r.loss for r in reference.steps}
    deltas = [(r.step, abs(r.loss - ref[r.step]) / max(abs(ref[r.step]), 1e-12))
              for r in progress.steps if r.step in ref]
    if not deltas:
        return _LossCompare()
    step, delta = deltas[-1]
    return _LossCompare(step, ref[step], delta, max(d for _, d in deltas), len(deltas))


def summarize_data(data: RunData) -> RunSummary:
    steps = data.progress.steps
    t0 = data.t0
    tokens = sum(r.tokens for r in steps)
    elapsed = steps[-1].time - t0
    cmp = _loss_vs(data.progress, data.reference)
    return RunSummary(
        run_dir=str(data.run_dir), steps=len(steps), first_step=steps[0].step, last_step=steps[-1].step,
        reruns=data.progress.reruns, epochs=sorted({r.epoch for r in steps}), tokens_total=tokens, elapsed_s=elapsed,
        tokens_per_s_overall=_tokens_per_s(steps), phases=phases(data),
        detections=[_detection(i, data.findings, steps, t0) for i in data.injections],
        reconfigs=list(data.progress.reconfigs), findings=len(data.findings), injections_from=data.injections_from,
        final_loss=steps[-1].loss, reference_final_loss=cmp.reference, final_loss_rel_delta=cmp.delta,
        loss_compared_at_step=cmp.step, loss_delta_vs_reference=cmp.max_delta, reference_steps_compared=cmp.common,
        stopped=data.progress.stopped, skipped_lines=dict(data.skipped), scenario=data.scenario,
        audits={a.new_epoch: f"x{a.ratio:.2f} {a.outcome.split(':')[0]}" for a in data.audits},
    )


def summarize(run_dir: Path | str) -> RunSummary:
    """Load ``run_dir`` and compute its summary (raises ReportError if there is nothing to report)."""
    return summarize_data(load_run(run_dir))
