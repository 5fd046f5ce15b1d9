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


def _run(out: Path, scenario: str) -> tuple[list[int | None], list[str]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(store.port), str(out), scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], logs


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sever") / "result.json"
    codes, logs = _run(out, "pipeline")
    assert codes == [0, -9, 0], [log[-2000:] for log in logs]  # rank 1 SIGKILLs itself
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


def test_a_rank_blocked_in_a_collective_of_the_whole_world_is_woken_too(tmp_path: Path) -> None:
    """DP over every rank of the world, rank 0's replica with one micro-batch against three:
    rank 0 waits in the DP all-reduce while ranks 1 and 2 leave the step (as ranks told of a
    death do) and let go of their groups. Its all-reduce must fail at once. It ran on the
    default group before, whose connections torch keeps open: a coordinator-chosen mixed-TP
    plan (TP1 replicas of one micro-batch beside TP2 ones) had its TP1 ranks wait the whole
    gloo timeout (6 s of a 6.45 s fail-stop recovery, ``resihp demo --slow-factor 1.8``)."""
    out = tmp_path / "result.json"
    codes, logs = _run(out, "world")
    assert codes == [0, 0, 0], [log[-2000:] for log in logs]
    result = json.loads(out.read_text())
    by_rank = {r["rank"]: r for r in result["ranks"]}
    assert "leaves the step" in by_rank[1]["error"] and "leaves the step" in by_rank[2]["error"]
    blocked = by_rank[0]
    assert blocked["error"] is not None, "rank 0's step cannot complete: its peers never join the all-reduce"
    assert "by peer" in blocked["error"] and "timeout" not in blocked["error"].lower(), blocked
    assert blocked["failed_after_s"] < result["gloo_timeout_s"] / 4, blocked
