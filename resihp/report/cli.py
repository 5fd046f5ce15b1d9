"""``resihp report RUN_DIR [--png FILE] [--no-png] [--json]``: the summary and timeline of a run.

Reads the run directory a ``resihp demo`` (or any ``resihp launch`` job whose trainer writes
``progress.jsonl``) leaves behind — see docs/run-dir.md — and prints a table: throughput per
phase (healthy, fail-slow, adapted, fail-stop, recovered), detection latency of every
injected fault, downtime and bytes moved per reconfiguration, final loss against the
reference run. It also writes a timeline PNG (default RUN_DIR/timeline.png). ``--json``
prints one JSON object with the same numbers instead of the table (for benchmarks).

Library use: ``summarize(run_dir) -> RunSummary`` and ``render_timeline(run_dir, png)``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from resihp.report.data import ReportError, RunData, load_run
from resihp.report.plot import render_timeline
from resihp.report.summary import RunSummary, summarize, summarize_data
from resihp.report.trace import PredictedSeries, predicted_times

__all__ = ["ReportError", "RunSummary", "main", "render_timeline", "summarize", "format_summary"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="resihp report", description="Print the summary table of a run directory and "
                                 "draw its timeline PNG (see docs/run-dir.md).")
    ap.add_argument("run_dir", help="the run directory (made by 'resihp demo'; see docs/run-dir.md)")
    ap.add_argument("--png", help="write the timeline here (default: RUN_DIR/timeline.png)")
    ap.add_argument("--no-png", action="store_true", help="do not draw the timeline (and do not replay the trace)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of the table")
    return ap


def _num(x: float | None, fmt: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024 or unit == "GiB":
            break
    return f"{x:.1f} {unit}"


def _steps(steps: tuple[int, ...]) -> str:
    if not steps:
        return "-"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def format_summary(s: RunSummary, trace_note: str = "") -> str:
    out = [f"run {s.run_dir}: {s.steps} steps ({s.first_step}-{s.last_step}), "
           f"{s.reruns} step line(s) replaced by a re-run, epochs {s.epochs}, {s.findings} findings, "
           f"injections from {s.injections_from}", ""]
    rows = [[p.label, _steps(p.steps), str(len(p.steps)), _num(p.tokens_per_s), _num(p.start_time_s),
             "-" if p.epoch is None else str(p.epoch), p.plan or "-"] for p in s.phases]
    rows.append(["overall, downtime included", f"{s.first_step}-{s.last_step}", str(s.steps),
                 _num(s.tokens_per_s_overall), "0.0", "", ""])
    out += _table(["phase", "steps", "n", "tokens/s", "from (s)", "epoch", "plan"], rows, {2, 3, 4, 5})
    out.append("tokens/s: tokens of a phase's steps after its first / time between their end times "
               "(the downtime before a phase's first step is excluded)")
    if s.detections:
        out.append("")
        rows = []
        for d in s.detections:
            what = f"slow x{d.factor:g} on rank {d.rank}" if d.kind == "slow" else f"kill of rank {d.rank}"
            found = f"{d.finding_kind} {list(d.finding_ranks)}" if d.finding_kind else "not detected"
            lat = _num(d.latency_s, ".2f", " s")
            if d.latency_iters is not None:
                lat += f" ({d.latency_iters} iterations)"
            rows.append([what, _num(d.injected_s), found, lat])
        out += _table(["injection", "at (s)", "finding", "detection latency"], rows, {1})
    if s.reconfigs:
        out.append("")
        # audit: the coordinator's measured verdict on a switch its planner chose (new time / old)
        rows = [[str(r.epoch), r.kind, str(r.step), _num(r.downtime_s, ".2f", " s"), _bytes(r.bytes_moved),
                 s.audits.get(r.epoch, "-"), r.plan] for r in s.reconfigs]
        out += _table(["epoch", "kind", "first step", "downtime", "moved", "audit", "plan"], rows, {0, 2, 3, 4})
    out.append("")
    if s.reference_final_loss is not None and s.final_loss_rel_delta is not None:
        out.append(f"final loss {s.final_loss:.4f} (step {s.last_step}), reference {s.reference_final_loss:.4f} "
                   f"(step {s.loss_compared_at_step}), relative delta {100 * s.final_loss_rel_delta:.3f} %; "
                   f"max relative delta over {s.reference_steps_compared} common steps "
                   f"{100 * (s.loss_delta_vs_reference or 0.0):.3f} %")
    else:
        out.append(f"final loss {s.final_loss:.4f} (step {s.last_step}); no reference run to compare "
                   f"(reference/progress.jsonl missing or sharing no step)")
    if s.stopped:
        out.append(f"the job stopped early: {s.stopped}")
    if trace_note:
        out.append(f"trace: {trace_note}")
    for name, n in sorted(s.skipped_lines.items()):
        out.append(f"warning: skipped {n} malformed line(s) of {name}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        data: RunData = load_run(args.run_dir)
    except ReportError as exc:
        print(f"resihp report: {exc}", file=sys.stderr)
        return 2
    summary = summarize_data(data)
    pred: PredictedSeries | None = None
    png: Path | None = None
    if not args.no_png:
        pred = predicted_times(Path(args.run_dir) / "trace.jsonl")
        try:
            png = render_timeline(args.run_dir, args.png, data=data, predicted=pred)
        except OSError as exc:
            print(f"resihp report: cannot write the timeline {args.png or 'timeline.png'!r}: {exc}", file=sys.stderr)
            return 2
    if args.json:
        obj: dict[str, Any] = summary.to_dict()
        obj["trace_note"] = pred.note if pred is not None else "not replayed (--no-png)"
        obj["predicted_iterations"] = len(pred.predicted_s) if pred is not None else 0
        obj["png"] = str(png) if png is not None else None
        print(json.dumps(obj, default=str))
        for name, n in sorted(summary.skipped_lines.items()):
            print(f"resihp report: warning: skipped {n} malformed line(s) of {name}", file=sys.stderr)
    else:
        print(format_summary(summary, pred.note if pred is not None else ""))
        if png is not None:
            print(f"timeline: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
