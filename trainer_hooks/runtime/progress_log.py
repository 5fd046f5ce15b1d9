"""``progress.jsonl``: the job's progress log, and the rank that writes it."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from resihp.coordinator.model.plan import Plan

PROGRESS_ENV = "RESIHP_PROGRESS"
log = logging.getLogger(__name__)


def loss_rank(plan: Plan) -> int:
    """The rank that writes the progress log: TP rank 0 of replica 0's last stage (it knows the
    global loss)."""
    return plan.replicas[0].stages[-1][0]


class ProgressLog:
    """``progress.jsonl``: one JSON object per line (step, reconfig, start, end); see docs/run-dir.md."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.unwritten = 0  # lines the file could not take (disk full, read-only)

    def write(self, record_type: str, /, **fields: Any) -> None:
        line = json.dumps({"type": record_type, "time": round(time.time(), 6), **fields}, separators=(",", ":"))
        try:
            with open(self.path, "a", encoding="utf-8") as fh:  # O_APPEND: short lines from several ranks interleave whole
                fh.write(line + "\n")
        except OSError as exc:  # a log the disk will not take must never stop training
            self.unwritten += 1
            if self.unwritten == 1:
                log.error("resihp: the progress log %s cannot be written (%s); training goes on without it",
                          self.path, exc)

