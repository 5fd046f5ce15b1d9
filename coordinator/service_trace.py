"""The job's trace file as the coordinator writes it (``TraceSink``).

Pure of gRPC and torch: records in, JSON lines out (``service_tracefmt.record_line``).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from resihp.coordinator.service_tracefmt import record_line
from resihp.coordinator.trace import IterationRecord, PlanChange, Record, TraceHeader, header_to_dict

log = logging.getLogger(__name__)


class TraceSink:
    """The job's trace (format v1) as the coordinator joins it: one file that outlives any rank.

    Written here rather than by a trainer rank because a rank may die or be regrouped at
    any step; the coordinator sees every report. Times are relative to the core's t0. A plan
    change is announced when its command goes out, but records of earlier iterations may
    still be joined after that; so it is held back and written just before the first record
    on the new plan (from its ``apply_at`` on, or earlier when a fail-stop recovery resumed
    before it: a record already shaped like the new plan)."""

    FLUSH_S = 1.0  # iteration records reach the file within this (the core's tick flushes too)

    def __init__(self, path: Any, header: TraceHeader, append: bool = False) -> None:
        self._fh = open(path, "a" if append else "w", encoding="utf-8", buffering=1 << 16)
        self._dp = header.plan.dp
        self._held: list[PlanChange] = []
        self._flushed = time.monotonic()
        self._dirty = False
        if not append:
            self._fh.write(json.dumps(header_to_dict(header), separators=(",", ":")) + "\n")
            self._fh.flush()

    def write(self, rec: Record) -> None:
        if isinstance(rec, PlanChange):
            self._held.append(rec)
            return
        if isinstance(rec, IterationRecord):
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
