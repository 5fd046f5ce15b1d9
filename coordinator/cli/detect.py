"""``resihp detect --trace FILE [--out FILE]``: replay a trace through the detector.

Findings go out as JSON Lines (one object per finding: iteration, kind, ranks, stage,
replica, factor, reason, plus cause, tp_group, evidence, time_s), to ``--out`` or stdout;
a one-line summary goes to stderr. A malformed trace stops the replay with a message that
names the line and the field, and exit code 2.

Heartbeat timeouts are checked against the trace's own clock: after every record the
detector ticks at that record's time.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import IO

from resihp.coordinator.detector.detector import Detector, DetectorConfig
from resihp.coordinator.model.trace import IterationRecord, TraceError, read_trace


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="resihp detect", description="Replay a trace through the detector; findings as JSON Lines.")
    ap.add_argument("--trace", required=True, help="trace file (JSON Lines, format 1; see docs/trace-format.md)")
    ap.add_argument("--out", help="write findings here instead of stdout")
    ap.add_argument("--config", help="detector options as a JSON object or a path to a JSON/YAML file "
                                     "(e.g. '{\"slow_threshold\": 0.08}'); see docs/detector.md")
    return ap


def _config(text: str | None) -> DetectorConfig:
    if not text:
        return DetectorConfig()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
    else:
        with open(text, encoding="utf-8") as fh:
            if text.endswith((".yaml", ".yml")):
                yaml = importlib.import_module("yaml")  # only needed for YAML configs
                data = yaml.safe_load(fh) or {}
            else:
                data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError("detector config must be an object of option: value")
    return DetectorConfig.from_dict(data)


def replay(lines: IO[str], out: IO[str], config: DetectorConfig) -> tuple[int, int]:
    """Replay; return (records, findings). Raises TraceError on a malformed line."""
    header, records = read_trace(lines)
    det = Detector(header, config)
    n_rec = n_find = 0
    for rec in records:
        n_rec += 1
        now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else getattr(rec, "time_s", 0.0)
        found = det.observe(rec, now) + det.tick(now)
        for f in found:
            out.write(json.dumps(f.to_json(), separators=(",", ":")) + "\n")
        n_find += len(found)
    return n_rec, n_find


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _config(args.config)
    except (ValueError, OSError) as exc:
        print(f"resihp detect: bad --config: {exc}", file=sys.stderr)
        return 2
    try:
        lines = open(args.trace, encoding="utf-8")
    except OSError as exc:
        print(f"resihp detect: cannot read trace {args.trace!r}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    except OSError as exc:
        lines.close()
        print(f"resihp detect: cannot write {args.out!r}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        with lines:
            n_rec, n_find = replay(lines, out, config)
    except TraceError as exc:
        print(f"resihp detect: {args.trace}: {exc}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"resihp detect: {n_rec} records, {n_find} findings", file=sys.stderr)
    return 0
