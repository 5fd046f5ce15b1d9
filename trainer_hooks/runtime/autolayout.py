"""Pick a job's initial TP × PP × DP layout by timing the candidates on its own devices: the
request (``AutoLayout``), how it travels (environment, the profile's one line), and its record.
The timing itself is runtime/layout_timing.py (torch); this module imports no torch, so the
launcher can use it.

Every rank builds each candidate layout in turn (process groups, its stage of the model,
the optimizer), trains ``warmup + steps`` iterations of throw-away weights on the job's
own batch stream, and takes the slowest rank's time of each (an all-reduce MAX on the world
group). A candidate already ``cutoff``× slower than the best so far after its first timed
iteration is not timed further. The choice is coordinator/planner/autolayout.choose.

Nothing of the profile reaches training: each candidate draws its own weights and reads its
own copy of the stream, so the job that follows starts from the same state as one started
at the chosen layout directly.

Under ``resihp launch --layout auto`` this runs once in a profile-only start of the training
script (``$RESIHP_LAYOUT_PROFILE=1``: rank 0 prints the choice as one ``RESIHP_LAYOUT_CHOICE``
line, and init leaves); the coordinator is started with that plan and the ranks read it
(``$RESIHP_LAYOUT_PLAN``).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.autolayout import Layout

LAYOUT_ENV = "RESIHP_LAYOUT"  # "auto": init without a plan picks one (resihp launch --layout auto)
LAYOUT_PLAN_ENV = "RESIHP_LAYOUT_PLAN"  # the layout the launcher's profile chose (TPaxPPbxDPc)
LAYOUT_PROFILE_ENV = "RESIHP_LAYOUT_PROFILE"  # "1": a profile-only start (rank 0 prints the choice, all leave)
MICROBATCHES_ENV = "RESIHP_MICROBATCHES"  # resihp launch --microbatches: the global micro-batches


@dataclass(frozen=True)
class AutoLayout:
    """``init(model, AutoLayout(microbatches=8))``: time the healthy layouts of this job's
    ranks for ``microbatches`` global micro-batches a step and train on the fastest (0: 2 per rank).
    ``max_candidates``: how many of the planner's best-predicted layouts are timed;
    ``warmup``/``steps``: iterations per candidate untimed / timed; ``cutoff``: stop timing a
    candidate this many times slower than the best so far."""

    microbatches: int = 0
    max_candidates: int = 12
    warmup: int = 1
    steps: int = 2
    cutoff: float = 1.5

    def __post_init__(self) -> None:
        if self.microbatches < 0 or self.max_candidates < 1 or self.warmup < 0 or self.steps < 1:
            raise SpecError(f"AutoLayout: need microbatches >= 0 (0: 2 per rank), max_candidates >= 1, warmup >= 0, steps >= 1; "
                            f"got {self.microbatches}, {self.max_candidates}, {self.warmup}, {self.steps}")
        if not (math.isfinite(self.cutoff) and self.cutoff > 1):
            raise SpecError(f"AutoLayout: cutoff must be a number > 1, got {self.cutoff!r}")


    def for_world(self, world_size: int) -> AutoLayout:
        return self if self.microbatches else replace(self, microbatches=2 * world_size)


def requested(plan: object) -> AutoLayout | None:
    """The AutoLayout ``init`` was given, or the one ``$RESIHP_LAYOUT=auto`` asks for when it was
    given no plan (global micro-batches: ``$RESIHP_MICROBATCHES``, else 2 per rank)."""
    if isinstance(plan, AutoLayout):
        return plan
    if plan is not None or os.environ.get(LAYOUT_ENV, "").strip() != "auto":
        return None
    text = os.environ.get(MICROBATCHES_ENV, "").strip()
    try:
        mbs = int(text) if text else 0
    except ValueError:
        raise SpecError(f"{MICROBATCHES_ENV}={text!r}: expected the global micro-batches a step, e.g. 8") from None
    return AutoLayout(microbatches=mbs)


def ranks_per_node(nodes: tuple[str, ...], rank: int) -> int:
    """Ranks on this rank's node: ``resihp launch --nodes K`` on one machine says it
    ($RESIHP_RANKS_PER_NODE); otherwise the ranks that share its host name."""
    text = os.environ.get("RESIHP_RANKS_PER_NODE", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return sum(1 for n in nodes if n == nodes[rank])


def planned_by_launcher(spec: ModelSpec, world: int, microbatches: int) -> Plan | None:
    """The plan ``resihp launch --layout auto`` chose before starting the ranks (None: none).
    It travels as ``TPaxPPbxDPc`` in the environment, so every node has it."""
    text = os.environ.get(LAYOUT_PLAN_ENV, "").strip()
    if not text:
        return None
    lay = Layout.parse(text)
    if lay.tp * lay.pp * lay.dp != world:
        raise SpecError(f"{LAYOUT_PLAN_ENV}={text}: {lay.tp * lay.pp * lay.dp} ranks, but this job has {world}")
    return lay.plan(spec.num_layers, microbatches)


CHOICE_MARK = "RESIHP_LAYOUT_CHOICE "  # a profile-only start's answer, one line on rank 0's stdout


def choice_line(record: dict[str, Any]) -> str:
    return CHOICE_MARK + json.dumps(record, separators=(",", ":"))


def read_choice(output: str) -> dict[str, Any] | None:
    """The record a profile-only start printed (the last one), or None."""
    for line in reversed(output.splitlines()):
        at = line.find(CHOICE_MARK)
        if at >= 0:
            try:
                got = json.loads(line[at + len(CHOICE_MARK):])
            except ValueError:
                return None
            return got if isinstance(got, dict) else None
    return None


def write_choice(record: dict[str, Any], path: str | Path) -> None:
    """The record of the choice, written whole or not at all."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, out)


def table(record: dict[str, Any]) -> str:
    """The profile as a table: each candidate's predicted time relative to the best predicted
    (the planner's ordering, on its configured profile) and its measured seconds."""
    cands = record["candidates"]
    fastest = min((c["predicted_s"] for c in cands if c["predicted_s"] > 0), default=1.0)
    lines = [f"layout profile: {record['model']} on {record['world']} ranks, {record['microbatches']} micro-batches "
             f"a step ({record['profile_s']:.1f} s)",
             f"  {'layout':<16} {'predicted':>9} {'measured s':>11}"]
    for c in cands:
        measured = statistics.median(c["measured_s"]) if c["measured_s"] else None
        mark = " <- chosen" if c["layout"] == record["layout"] else (" (cut short)" if c["cut_short"] else "")
        shown = f"{measured:.4f}" if measured is not None else "-"
        lines.append(f"  {c['layout']:<16} {c['predicted_s'] / fastest:>8.2f}x {shown:>11}{mark}")
    lines.append(f"  chosen: {record['reason']}")
    return "\n".join(lines)
