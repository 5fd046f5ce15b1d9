"""A rank that lets go of its groups wakes the pipeline neighbours blocked on it (real gloo).

Each pair of pipeline neighbours talks on a two-rank group of its own (trainer_hooks/runtime/groups.py),
so a rank that sees a failure and severs its groups closes those connections, and a neighbour
blocked in a receive from it fails at once instead of waiting out gloo's timeout; it then
severs its own, and so on down the pipeline. On the default group (before session 8) the
receive waited the whole timeout: the default group keeps references torch itself holds.
"""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_pipeline_sever_worker.py")
WORLD = 3


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.distributed as dist

    out = tmp_path_factory.mktemp("sever") / "result.json"
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(store.port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, -9, 0], [log[-2000:] for log in logs]  # rank 1 SIGKILLs itself
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_blocked_neighbour_fails_long_before_the_gloo_timeout(outcome: dict[str, Any]) -> None:
    """Rank 1 dies mid-step; rank 0 fails in TP with it and lets go of its groups; rank 2,
    blocked receiving from rank 0, which is alive, must fail soon after, not at the timeout."""
    timeout = outcome["gloo_timeout_s"]
    by_rank = {r["rank"]: r for r in outcome["ranks"]}
    for rank in (0, 2):
        r = by_rank[rank]
        assert r["error"] is not None, f"rank {rank}'s step should have failed: rank 1 died mid-step"
        assert r["failed_after_s"] < timeout / 4, (rank, r)
        # the neighbour's end of the connection went away: not a timeout
        assert "by peer" in r["error"] and "timeout" not in r["error"].lower(), (rank, r)
