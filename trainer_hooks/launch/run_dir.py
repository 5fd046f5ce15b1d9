"""The run directory between jobs: what one job leaves there, and setting it aside when a new
job starts in the same directory (``resihp launch`` again, its own restart command, a second
``resihp demo``)."""
from __future__ import annotations

import json
from pathlib import Path

# what one job's daemons and ranks write in the run directory; an earlier job's are set aside
# before a new job starts there (checkpoints, profiles and anything else stay where they are)
JOB_FILES = ("journal.jsonl", "events.jsonl", "trace.jsonl", "progress.jsonl", "coordinator.json", "coordinator.log",
             "agents.log", "store.json", "store.log", "faults.jsonl", "token", "hostfile", "demo.json")
JOB_FILE_PATTERNS = ("agent-*.json", "agent-*.log")


def set_aside_earlier_job(run: Path) -> str:
    """Move an earlier job's files (``run`` holds its coordinator's journal) to
    ``run/previous/<its job>/``, so that this job's coordinator starts afresh instead of
    resuming another job's journal (its epoch, plan and exclusions), and the event log and
    progress log are this job's alone. Checkpoints stay: a restart resumes from them.
    Returns a line saying what moved ('' when nothing)."""
    journal = run / "journal.jsonl"
    if not journal.exists():
        return ""
    earlier = ""
    with open(journal, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("type") == "start":
                earlier = str(entry.get("job", ""))
                break
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in earlier) or "unknown-job"
    dest = run / "previous" / name
    k = 1
    while dest.exists():
        k += 1
        dest = run / "previous" / f"{name}.{k}"
    dest.mkdir(parents=True)
    moved = [p for p in run.iterdir() if p.is_file() and (p.name in JOB_FILES or any(p.match(g) for g in JOB_FILE_PATTERNS))]
    for path in moved:
        path.replace(dest / path.name)
    return (f"run dir {run} held the files of job {earlier or '(unnamed)'}; moved {len(moved)} of them to {dest} "
            f"(this job starts afresh; checkpoints and other files stay)")
