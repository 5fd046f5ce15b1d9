"""Running ``resihp demo`` from a test, and reading its run directory's JSON Lines files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_demo(out: Path, *args: str, timeout_s: int = 600) -> Path:
    """``resihp demo ARGS --quiet --run-dir OUT`` (the launcher gives up after ``timeout_s``);
    fails with the tails of its output and of launch.log unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "demo", *args, "--quiet", "--run-dir", str(out),
         "--timeout-s", str(timeout_s)],
        capture_output=True, text=True, timeout=timeout_s + 300,
    )
    log = out / "launch.log"
    assert proc.returncode == 0, \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log.read_text()[-3000:] if log.exists() else ''}"
    return out


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
