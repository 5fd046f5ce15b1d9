"""Loading a run directory (docs/run-dir.md) into typed records: no analysis, no plotting.

Every reader is tolerant: a line that is not a JSON object, or a known record whose fields
have the wrong type, is skipped and counted per file (``RunData.skipped``), never fatal,
because a killed job leaves torn last lines behind. Unknown record types and events are
ignored silently (they are not errors: the format grows). Pure: no matplotlib, torch or grpc.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError

PROGRESS = "progress.jsonl"
EVENTS = "events.jsonl"
TRACE = "trace.jsonl"
DEMO = "demo.json"
REFERENCE = "reference/progress.jsonl"


class ReportError(Exception):
    """The run directory cannot be reported on (the message says what to run)."""


@dataclass(frozen=True)
class StepRow:
    step: int
    loss: float
    tokens: int
    time: float  # wall clock at the end of the step
    step_s: float
    epoch: int
    plan: str


@dataclass(frozen=True)
class Reconfig:
    kind: str  # planned | fail-stop
    epoch: int
    step: int  # first step on the new plan
    time: float
    downtime_s: float
    bytes_moved: int
    plan: str
    reason: str


@dataclass(frozen=True)
class Injection:
    kind: str  # slow | kill
    rank: int
    time: float
    factor: float = 1.0
    step: int | None = None


@dataclass(frozen=True)
class FindingEvent:
    time: float  # the event's wall clock (when the coordinator logged it)
    kind: str  # fail-slow | fail-stop | recovered | ...
    ranks: tuple[int, ...]
    iteration: int
    factor: float
    cause: str
    reason: str


@dataclass(frozen=True)
class AuditEvent:
    """The coordinator's plan audit of a switch: the new plan's measured time over the old one's."""

    new_epoch: int
    ratio: float
    outcome: str  # kept | undone | kept: <why it could not be undone>


@dataclass(frozen=True)
class CommandEvent:
    time: float
    epoch: int
    kind: str
    apply_at: int
    plan: str
    reason: str


@dataclass
class Progress:
    steps: list[StepRow] = field(default_factory=list)  # sorted by step, the last line of a step wins
    reconfigs: list[Reconfig] = field(default_factory=list)
    start: float | None = None
    start_plan: str = ""
    world: int = 0
    end: float | None = None
    stopped: str = ""  # the reason of a ``stopped`` line (the job could not go on)
    reruns: int = 0  # step lines overridden by a later line for the same step


@dataclass
class RunData:
    run_dir: Path
    progress: Progress
    reference: Progress | None
    injections: list[Injection]
    injections_from: str  # "demo.json" | "events.jsonl" | "none"
    findings: list[FindingEvent]
    commands: list[CommandEvent]
    scenario: dict[str, Any]
    coordinator_start: float | None
    skipped: Counter[str] = field(default_factory=Counter)  # file name -> malformed lines skipped
    audits: list[AuditEvent] = field(default_factory=list)

    @property
    def t0(self) -> float:
        """Job start (the x axis origin): the trainer's start line, else the coordinator's
        start, else the start of the first step."""
        p = self.progress
        if p.start is not None:
            return p.start
        if self.coordinator_start is not None:
            return self.coordinator_start
        return p.steps[0].time - p.steps[0].step_s if p.steps else 0.0


def plan_label(plan: Mapping[str, Any]) -> str:
    """A compact description of a plan dict, the one the trainer writes (``Plan.describe``)."""
    try:
        p = Plan.from_dict(plan)
    except (SpecError, KeyError, TypeError, ValueError):
        return "?"
    describe = getattr(p, "describe", None)
    if callable(describe):
        return str(describe())
    layers = "/".join(",".join(str(n) for n in lay) for lay in sorted({r.layers for r in p.replicas}))
    even = all(len(set(r.layers)) == 1 for r in p.replicas) and len({r.layers for r in p.replicas}) == 1
    return (f"TP{p.tp}xPP{p.pp}xDP{p.dp}" + ("" if even else f" L{layers}")
            + f" mb {','.join(str(r.microbatches) for r in p.replicas)}")


def _lines(path: Path, skipped: Counter[str], key: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for text in fh:
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                skipped[key] += 1
                continue
            if isinstance(obj, dict):
                out.append(obj)
            else:
                skipped[key] += 1
    return out


def _num(obj: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def _int(obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return v


def load_progress(path: Path, skipped: Counter[str], key: str) -> Progress:
    prog = Progress()
    by_step: dict[int, StepRow] = {}
    for obj in _lines(path, skipped, key):
        kind = obj.get("type")
        try:
            if kind == "step":
                row = StepRow(_int(obj, "step"), _num(obj, "loss"), _int(obj, "tokens", 0), _num(obj, "time"),
                              _num(obj, "step_s", 0.0), _int(obj, "epoch", 0), str(obj.get("plan", "")))
                if row.step in by_step:
                    prog.reruns += 1
                by_step[row.step] = row  # a re-run after a rollback replaces the first attempt
            elif kind == "reconfig":
                prog.reconfigs.append(Reconfig(
                    str(obj.get("kind", "planned")), _int(obj, "epoch"), _int(obj, "step"), _num(obj, "time"),
                    _num(obj, "downtime_s", 0.0), _int(obj, "bytes_moved", 0), str(obj.get("plan", "")),
                    str(obj.get("reason", ""))))
            elif kind == "start":
                prog.start = _num(obj, "time")
                prog.start_plan = str(obj.get("plan", ""))
                prog.world = _int(obj, "world", 0)
            elif kind == "end":
                prog.end = _num(obj, "time")
            elif kind == "stopped":
                prog.stopped = f"rank {obj.get('rank', '?')} at step {obj.get('step', '?')}: {obj.get('reason', '')}"
        except ValueError:
            skipped[key] += 1
    prog.steps = [by_step[s] for s in sorted(by_step)]
    prog.reconfigs.sort(key=lambda r: r.time)
    return prog


def _injection(obj: Mapping[str, Any]) -> Injection:
    kind = obj.get("kind")
    if kind not in ("slow", "kill"):
        raise ValueError(f"injection kind must be slow or kill, got {kind!r}")
    step = obj.get("step")
    return Injection(str(kind), _int(obj, "rank"), _num(obj, "time"), _num(obj, "factor", 1.0),
                     step if isinstance(step, int) and not isinstance(step, bool) else None)


def load_events(path: Path, skipped: Counter[str]) -> tuple[list[FindingEvent], list[CommandEvent],
                                                             list[Injection], float | None, list[AuditEvent]]:
    findings: list[FindingEvent] = []
    commands: list[CommandEvent] = []
    injections: list[Injection] = []
    audits: list[AuditEvent] = []
    started: float | None = None
    for obj in _lines(path, skipped, EVENTS):
        ev = obj.get("event")
        try:
            if ev == "finding":
                ranks = obj.get("ranks", [])
                if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
                    raise ValueError("ranks must be a list of integers")
                findings.append(FindingEvent(_num(obj, "time"), str(obj.get("kind", "")), tuple(ranks),
                                             _int(obj, "iteration", -1), _num(obj, "factor", 1.0),
                                             str(obj.get("cause", "")), str(obj.get("reason", ""))))
            elif ev == "command":
                plan = obj.get("plan")
                commands.append(CommandEvent(_num(obj, "time"), _int(obj, "epoch"), str(obj.get("kind", "")),
                                             _int(obj, "apply_at", -1),
                                             plan_label(plan) if isinstance(plan, dict) else "",
                                             str(obj.get("reason", ""))))
            elif ev == "inject":
                injections.append(_injection(obj))
            elif ev == "plan-audit":
                audits.append(AuditEvent(_int(obj, "new_epoch"), _num(obj, "ratio"), str(obj.get("outcome", ""))))
            elif ev in ("coordinator-started", "coordinator-resumed") and started is None:
                started = _num(obj, "time")
        except ValueError:
            skipped[EVENTS] += 1
    findings.sort(key=lambda f: f.time)
    commands.sort(key=lambda c: c.time)
    injections.sort(key=lambda i: i.time)
    return findings, commands, injections, started, audits


def load_demo(path: Path, skipped: Counter[str]) -> tuple[dict[str, Any], list[Injection]] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError:
        skipped[DEMO] += 1
        return None
    if not isinstance(obj, dict):
        skipped[DEMO] += 1
        return None
    scenario = obj.get("scenario")
    injections: list[Injection] = []
    raw = obj.get("injections", [])
    for item in raw if isinstance(raw, list) else []:
        try:
            if not isinstance(item, dict):
                raise ValueError("an injection must be an object")
            injections.append(_injection(item))
        except ValueError:
            skipped[DEMO] += 1
    injections.sort(key=lambda i: i.time)
    return (scenario if isinstance(scenario, dict) else {}), injections


def load_run(run_dir: Path | str) -> RunData:
    """Read everything a report needs; raises ReportError when there is nothing to report."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(f"run directory {str(run)!r} does not exist; run 'resihp demo' to make one")
    prog_path = run / PROGRESS
    if not prog_path.is_file():
        raise ReportError(f"{str(prog_path)!r} is missing: {str(run)!r} is not the run directory of a training run "
                          f"(run 'resihp demo' to make one)")
    skipped: Counter[str] = Counter()
    progress = load_progress(prog_path, skipped, PROGRESS)
    if not progress.steps:
        raise ReportError(f"{str(prog_path)!r} holds no step lines: the run trained no step "
                          f"(run 'resihp demo' to make one)")
    ref_path = run / REFERENCE
    reference = load_progress(ref_path, skipped, REFERENCE) if ref_path.is_file() else None
    findings: list[FindingEvent] = []
    commands: list[CommandEvent] = []
    injections: list[Injection] = []
    started = None
    audits: list[AuditEvent] = []
    if (run / EVENTS).is_file():
        findings, commands, injections, started, audits = load_events(run / EVENTS, skipped)
    source = "events.jsonl" if injections else "none"
    scenario: dict[str, Any] = {}
    demo = load_demo(run / DEMO, skipped) if (run / DEMO).is_file() else None
    if demo is not None:
        scenario = demo[0]
        if demo[1]:  # the driver's own record knows the step; the events only the time
            injections, source = demo[1], "demo.json"
    return RunData(run, progress, reference, injections, source, findings, commands, scenario, started, skipped,
                   audits)
