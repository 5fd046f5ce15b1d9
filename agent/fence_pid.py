"""SIGKILL of a process by pid, only if it belongs to the job: the one act of fencing, shared by
a node's agent and by whoever fences in its place while it is gone (trainer_hooks/launch/orphan_fences.py).
A pid named by the coordinator may have been reused since the verdict; the process's own
environment (RESIHP_JOB, which every rank inherits from its launcher) says whether it is ours."""
from __future__ import annotations

import os
import signal


def is_job_process(pid: int, job: str) -> bool:
    """Whether ``pid`` runs in job ``job`` (its environment says RESIHP_JOB=job): a fence by pid
    must never hit a process that merely reuses a dead rank's pid."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return f"RESIHP_JOB={job}".encode() in env


def sigkill(pid: int, where: str) -> tuple[bool, str]:
    """SIGKILL ``pid``: (whether it is now gone or going, what happened, for the event log)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True, f"pid {pid} had already exited"
    except OSError as exc:
        return False, f"SIGKILL of pid {pid} failed: {exc}"
    return True, f"SIGKILL sent to pid {pid} on {where}"
