"""init / step end to end in one real process: no agent, env-injected throttle, recorded trace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from resihp.coordinator.model.trace import IterationRecord, load_trace

REPO = Path(__file__).resolve().parents[1]


def test_hooks_train_report_throttle_and_trace_without_an_agent(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_")}
    env.update({"RESIHP_THROTTLE": "0:3.0@2", "PYTHONHASHSEED": "0"})
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mpi_scripts" / "hooks_smoke.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("no node agent") == 1, proc.stderr  # one warning, training went on
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["factors"] == [1.0, 1.0, 3.0, 3.0, 3.0]  # applied at the boundary before iteration 2
    assert summary["losses"][-1] < summary["losses"][0]

    header, records = load_trace(str(tmp_path / "trace.jsonl"))
    its = [r for r in records if isinstance(r, IterationRecord)]
    assert [r.iteration for r in its] == [0, 1, 2, 3, 4]
    assert header.model.name == "gpt-smoke" and header.tokens_per_microbatch == 32
    for rec in its:
        assert len(rec.seqlens) == 1 and len(rec.seqlens[0]) == 4
        assert all(sum(mb) == 32 for mb in rec.seqlens[0])
        kinds = [c.kind for c in rec.chunks]
        assert kinds.count("F") == 4 and kinds.count("B") == 4 and "DP" in kinds and "OPT" in kinds
