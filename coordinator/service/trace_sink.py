"""The job's trace file as the coordinator writes it (``TraceSink``).

Pure of gRPC and torch: records in, JSON lines out (``service.tracefmt.record_line``).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from resihp.coordinator.model.trace import IterationRecord, PlanChange, Record, TraceHeader, header_to_dict
from resihp.coordinator.service.tracefmt import record_line

log = logging.getLogger(__name__)


class TraceSink:
    """The job's trace (format v1) as the coordinator joins it: one file that outlives any rank.

    Written here rather than by a trainer rank because a rank may die or be regrouped at
    any step; the coordinator sees every report. Times are relative to the core's t0. A plan
    change is announced when its command goes out, but records of earlier iterations may
    still be joined after that; so it is held back and written just before the first record
    on the new plan. The core says which plan epoch each record was built with, so that is
    exact: a switch that came a boundary or two after ``apply_at`` (a late command) and a
    fail-stop recovery that resumed before it are both placed where the ranks switched.
    Without the epoch, the change goes before the first record from ``apply_at`` on or
    shaped like the new plan (its replica count)."""

    FLUSH_S = 1.0  # iteration records reach the file within this (the core's tick flushes too)

    def __init__(self, path: Any, header: TraceHeader, append: bool = False) -> None:
        self._fh = open(path, "a" if append else "w", encoding="utf-8", buffering=1 << 16)
        self._dp = header.plan.dp
        self._held: list[PlanChange] = []
        self._flushed = time.monotonic()
        self._dirty = False
        self._records = 0  # lines written after the header
        if not append:
            self._fh.write(json.dumps(header_to_dict(header), separators=(",", ":")) + "\n")
            self._fh.flush()

    def replace_header(self, header: TraceHeader) -> bool:
        """Write ``header`` in place of the first one while nothing follows it (the trainers
        said their model before their first report); False once records were written."""
        if self._records or self._held:
            return False
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(json.dumps(header_to_dict(header), separators=(",", ":")) + "\n")
        self._fh.flush()
        self._dp = header.plan.dp
        return True

    def write(self, rec: Record, epoch: int | None = None) -> None:
        """``epoch``: for an iteration record, the plan epoch it was built with (the joiner
        knows it). A held plan change goes out just before the first record of its epoch or a
        later one, whatever its ``apply_at``: a late switch, or a recovery that resumed early."""
        if isinstance(rec, PlanChange):
            self._held.append(rec)
            return
        if isinstance(rec, IterationRecord) and epoch is not None:
            due = [pc for pc in self._held if pc.plan.epoch <= epoch]
            if due:
                # only the newest is the plan this record ran; older ones were superseded unrun
                self._held = [pc for pc in self._held if pc.plan.epoch > epoch]
                newest = max(due, key=lambda pc: pc.plan.epoch)
                self._dp = newest.plan.dp
                self._line(PlanChange(rec.iteration, newest.plan))
        elif isinstance(rec, IterationRecord):
            for pc in list(self._held):
                shaped = len(rec.seqlens) == pc.plan.dp != self._dp
                if rec.iteration >= pc.iteration or shaped:
                    self._held.remove(pc)
                    self._dp = pc.plan.dp
                    self._line(PlanChange(min(pc.iteration, rec.iteration), pc.plan))
        self._line(rec)
        # iteration records are buffered (one write per second or so, not one per iteration);
        # exits and plan changes, rare and what a reader waits for, go out at once
        if not isinstance(rec, IterationRecord) or time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def _line(self, rec: Record) -> None:
        try:
            self._fh.write(record_line(rec) + "\n")
            self._dirty = True
            self._records += 1
        except (TypeError, ValueError, OSError) as exc:  # a trace problem must not stop the control plane
            log.warning("trace: could not write %s: %s", type(rec).__name__, exc)

    def flush(self, stale_s: float = 0.0) -> None:
        """Write out what is buffered (with ``stale_s``: only if the last flush is that old)."""
        if not self._dirty or time.monotonic() - self._flushed < stale_s:
            return
        try:
            self._fh.flush()
        except (ValueError, OSError) as exc:
            log.warning("trace: could not flush: %s", exc)
        self._flushed = time.monotonic()
        self._dirty = False

    def close(self) -> None:
        self.flush()
        self._fh.close()
