"""The predicted (healthy) iteration time of every traced iteration, by replaying the run's
trace through the real detector offline.

The detector calibrates its cost model on the first healthy iterations (``warmup_iters``)
and keeps learning from healthy ones; for every iteration it judges on per-chunk timings it
can simulate the compiled pipeline schedule over the predicted op times
(``Detector.predicted_iteration_s``): what the iteration should have cost with every
device healthy, for the very batches it ran. Iterations it does not price (warm-up, or a
trace with only per-rank step times) get no point. A missing, unreadable or truncated trace
(a killed job) degrades to what could be read, with a one-line note; never an exception.
Pure: numpy via the detector, no matplotlib.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from resihp.coordinator.detector.detector import Detector, DetectorConfig
from resihp.coordinator.model.trace import IterationRecord, TraceError, read_trace


@dataclass
class PredictedSeries:
    iterations: list[int] = field(default_factory=list)
    predicted_s: list[float] = field(default_factory=list)
    observed_s: list[float] = field(default_factory=list)  # the trace's own time_s of the same iterations
    traced: int = 0  # iteration records read
    note: str = ""  # one line: what was (not) possible

    def by_iteration(self) -> dict[int, float]:
        return dict(zip(self.iterations, self.predicted_s))


def predicted_times(path: Path | str, config: DetectorConfig | None = None) -> PredictedSeries:
    out = PredictedSeries()
    p = Path(path)
    if not p.is_file():
        out.note = f"no {p.name} in the run directory: no predicted-time curve"
        return out
    stopped = ""
    with p.open(encoding="utf-8", errors="replace") as fh:
        try:
            header, records = read_trace(fh)
        except TraceError as exc:
            out.note = f"{p.name} has no readable header ({exc}): no predicted-time curve"
            return out
        det = Detector(header, config or DetectorConfig())
        try:
            for rec in records:
                now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else float(getattr(rec, "time_s", 0.0))
                marker: dict[str, float] = {}
                det.last = marker  # the detector replaces it with a new dict when it prices an iteration
                det.observe(rec, now)
                det.tick(now)
                if not isinstance(rec, IterationRecord):
                    continue
                out.traced += 1
                if det.last is marker:
                    continue
                pred = det.predicted_iteration_s()
                if pred is not None and math.isfinite(pred) and pred > 0:
                    out.iterations.append(rec.iteration)
                    out.predicted_s.append(float(pred))
                    out.observed_s.append(rec.time_s)
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # TraceError is a ValueError: a torn last line
            stopped = f"; stopped reading at a malformed record ({exc})"
    out.note = _note(out, stopped, det)
    return out


def _note(out: PredictedSeries, stopped: str, det: Detector) -> str:
    if out.predicted_s:
        return f"predicted time for {len(out.predicted_s)} of {out.traced} traced iterations{stopped}"
    if not out.traced:
        return f"no predicted-time curve: the trace holds no iteration records{stopped}"
    why = (f"the detector priced none of the {out.traced} traced iterations (warm-up is "
           f"{det.config.warmup_iters} iterations; per-chunk timings are needed)")
    return f"no predicted-time curve: {why}{stopped}"
