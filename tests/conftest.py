"""Shared test helpers."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def world1() -> Iterator[None]:
    """A one-rank gloo world in this process (the runtime needs an initialised default group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def resihp_exe() -> str:
    """The installed console script of the interpreter running the tests."""
    exe = VENV_BIN / "resihp"
    return str(exe) if exe.exists() else "resihp"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # every mpirun the tests start: PMIx's hash datastore (its shared-memory one has crashed
    # ranks inside MPI_Init on this oversubscribed machine; open-mpi/ompi#6761)
    os.environ.setdefault("PMIX_MCA_gds", "hash")


@pytest.fixture(scope="session", autouse=True)
def _no_stale_open_mpi_segments() -> None:
    """Open MPI names a job's shared-memory segment after mpirun's pid. A segment left behind
    by a killed job can be mapped by a later job whose mpirun got the same pid, and then a rank
    segfaults at start-up (seen as MPI_ERR_PROC_FAILED in Comm.Dup). Remove stale segments and
    session directories before the tests start, but only when no mpirun is running."""
    from resihp.trainer_hooks.launch.launcher import remove_stale_mpi_segments

    remove_stale_mpi_segments()
