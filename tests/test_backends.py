"""The backend a world is made with (launch/backends.py): under NCCL it also carries gloo, so a
live switch's CPU buffers have a backend; what a group runs is read from torch's answer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resihp.trainer_hooks.launch.backends import (
    carries_cpu,
    group_carries_cpu,
    group_runs_nccl,
    runs_nccl,
    world_backend,
)


def test_an_nccl_job_makes_its_world_with_gloo_for_cpu_tensors() -> None:
    assert world_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert world_backend("gloo") == "gloo"


def test_an_unknown_job_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"backend 'mpi': expected one of gloo, nccl"):
        world_backend("mpi")


@pytest.mark.parametrize(("answer", "nccl", "cpu"), [
    ("nccl", True, False),  # a script's own world under NCCL: no CPU tensors
    ("gloo", False, True),
    ("cpu:gloo,cuda:nccl", True, True),  # resihp's world under NCCL
    ("cuda:nccl,cpu:gloo", True, True),
    ("cuda:nccl", True, False),
    ("cpu:gloo", False, True),
    ("ucc", False, False),
])
def test_what_a_backend_answer_runs(answer: str, nccl: bool, cpu: bool) -> None:
    assert runs_nccl(answer) is nccl
    assert carries_cpu(answer) is cpu


def test_no_world_neither_runs_nccl_nor_carries_cpu() -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    assert not group_runs_nccl()
    assert not group_carries_cpu()


def test_a_device_mapped_world_is_read_and_its_subgroups_inherit_it() -> None:
    """A real world made with a device map (the form resihp's NCCL world takes; gloo alone
    here, no CUDA): torch answers the map, which is read right, and a group made from it
    without a backend carries CPU tensors."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        assert str(dist.get_backend()) == "cpu:gloo"
        assert group_carries_cpu() and not group_runs_nccl()
        sub = dist.new_group([0])
        assert group_carries_cpu(sub)
        t = torch.tensor([2.0, 3.0])
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [2.0, 3.0]
    finally:
        dist.destroy_process_group()
