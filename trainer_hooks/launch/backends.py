"""Which torch.distributed backend a world is made with, and which one a group runs.

The job's backend is ``gloo`` (CPU) or ``nccl`` (CUDA). Under NCCL the default group and
every group made from it also carry gloo for CPU tensors: a live switch moves its pieces as
CPU byte buffers with CPU int64 headers (``reconfig/transfer.py``), and a group made with
backend ``nccl`` alone refuses them ("No backend type associated with device type cpu").
torch routes each collective to the backend of its tensors' device (``cpu:gloo,cuda:nccl``,
as torchtitan does for CPU-side collectives), and ``new_group`` without a backend inherits
the default group's. ``dist.get_backend`` then answers that whole string, not ``"nccl"``.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

JOB_BACKENDS = ("gloo", "nccl")


def world_backend(backend: str) -> str:
    """The backend string ``init_process_group`` gets for the job's backend."""
    if backend not in JOB_BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(JOB_BACKENDS)}")
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


def runs_nccl(backend: str) -> bool:
    """A backend string (``dist.get_backend``'s answer) that sends CUDA tensors over NCCL:
    ``nccl`` alone (a script's own world) or a device map holding it."""
    return any(part.rpartition(":")[2].strip() == "nccl" for part in str(backend).lower().split(","))


def group_runs_nccl(group: Any = None) -> bool:
    """The (default) group exists and runs NCCL for CUDA tensors."""
    return dist.is_initialized() and runs_nccl(str(dist.get_backend(group)))


def carries_cpu(backend: str) -> bool:
    """A backend string that takes CPU tensors: gloo, alone or in a device map (``nccl`` alone,
    a script's own world under NCCL, does not)."""
    return any(part.rpartition(":")[2].strip() == "gloo" for part in str(backend).lower().split(","))


def group_carries_cpu(group: Any = None) -> bool:
    """The (default) group exists and takes CPU tensors."""
    return dist.is_initialized() and carries_cpu(str(dist.get_backend(group)))
