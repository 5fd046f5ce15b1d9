"""ULFM fail-stop recovery under a real ``mpirun --with-ft ulfm`` with 4 ranks.

A rank SIGKILLs itself in the middle of a collective (gloo, then MPI, or during the
recovery itself); the survivors shrink the communicator, agree on the last completed step,
bootstrap a new gloo world from the shrunk communicator (the store lives in a separate
process), all-reduce in it correctly and resume from the agreed step.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from resihp.trainer_hooks.reconfig.ulfm import FT_MPIRUN_ARGS, StoreProcess

WORKER = Path(__file__).with_name("_ulfm_worker.py")
MPIRUN = Path(sys.executable).parent / "mpirun"
N = 4

# Real multi-process jobs (mpirun with ULFM, gloo, gRPC daemons) on a 2-core machine: an
# infrastructure crash (e.g. Open MPI's ULFM segfaulting a rank at start-up, seen once in five
# full runs) gets one fresh retry; a real regression fails both times.
pytestmark = [pytest.mark.flaky(reruns=1), pytest.mark.skipif(not MPIRUN.exists() and not shutil.which("mpirun"), reason="needs Open MPI's mpirun")]


def run_job(
    spec: dict[str, Any], survivors: list[int], out: Path, deadline_s: float = 150.0
) -> tuple[dict[int, Any], str]:
    """Start the job, wait until every survivor reported, then end mpirun (it may hang in finalisation)."""
    with StoreProcess() as store:
        env = dict(os.environ, **store.client_env())  # address and the ranks' credential
        log = (out / "mpirun.log").open("w")
        cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", *FT_MPIRUN_ARGS, "-n", str(N),
               sys.executable, str(WORKER), str(out), json.dumps(spec)]
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        reports: dict[int, Any] = {}
        end = time.monotonic() + deadline_s
        try:
            while time.monotonic() < end and len(reports) < len(survivors):
                for r in survivors:
                    f = out / f"{r}.json"
                    if r not in reports and f.exists():
                        reports[r] = json.loads(f.read_text())
                if job.poll() is not None and len(reports) < len(survivors):
                    break  # mpirun ended before everyone reported
                time.sleep(0.1)  # polling the report files, with a deadline
        finally:
            _end(job)
            log.close()
    return reports, (out / "mpirun.log").read_text()


def _end(job: subprocess.Popen[bytes]) -> None:
    procs = []
    try:
        procs = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=10)
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:  # ranks that escaped mpirun's process group: ours, end them by pid
        p.kill()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_failures_gloo_then_mpi(tmp_path: Path) -> None:
    # rank 0 dies in step 3's gloo all-reduce: 4 -> 3 ranks; then rank 2 dies in step 5's
    # MPI all-reduce: 3 -> 2. Each time the survivors agree, rebuild gloo and resume.
    spec = {"steps": 8, "kills": [[3, "gloo", 0], [5, "mpi", 2]]}
    reports, log = run_job(spec, [1, 3], tmp_path)
    assert sorted(reports) == [1, 3], f"missing reports; mpirun log:\n{log[-4000:]}"
    for r, rep in reports.items():
        assert rep["final_step"] == 7 and rep["members"] == [1, 3]
        first, second = rep["records"]
        assert first["survivors"] == [1, 2, 3] and first["failed"] == [0]  # shrank to 3, in order
        assert first["new_rank"] == [1, 2, 3].index(r)
        assert first["agreed_step"] == 2 and first["local_step"] == 2  # step 3 completed nowhere
        assert first["epoch"] == 1 and first["prefix"] == "resihp/epoch1/"
        assert first["sum"] == 2 + 3 + 4  # all-reduce of logical rank + 1 in the new gloo world
        assert first["attempts"] == 1 and first["detected"]
        assert second["survivors"] == [1, 3] and second["failed"] == [2]
        assert second["agreed_step"] == 4 and second["epoch"] == 2 and second["prefix"] == "resihp/epoch2/"
        assert second["sum"] == 2 + 4
        assert "MPI_ERR_PROC_FAILED" in second["detected"] or "REVOKED" in second["detected"]
    # every rank process is gone once the test has ended mpirun
    assert not [rep["pid"] for rep in reports.values() if _running(rep["pid"])]


def test_second_failure_during_recovery_is_survived(tmp_path: Path) -> None:
    # rank 0 dies in a gloo all-reduce; rank 3 dies while the survivors shrink
    reports, log = run_job({"steps": 6, "kills": [[3, "gloo", 0]], "recovery_victim": 3}, [1, 2], tmp_path)
    assert sorted(reports) == [1, 2], f"missing reports; mpirun log:\n{log[-4000:]}"
    for rep in reports.values():
        (rec,) = rep["records"]
        assert rec["survivors"] == [1, 2] and rec["failed"] == [0, 3]
        assert rec["attempts"] == 2  # the first shrink's agreement saw rank 3 die; the second held
        assert rec["agreed_step"] == 2 and rec["epoch"] == 1
        assert rec["sum"] == 2 + 3
        assert rep["final_step"] == 5
