"""Chunk timing and the compute throttle on a real GPU (CUDA events; trainer_hooks/runtime/chunk_clock.py).

Skipped without CUDA (CI has none); ``bash bench/gpu_check.sh`` runs it on a GPU machine.
A CUDA op returns once its kernels are queued, so what these tests pin down is that the
runtime's F/B spans are the device's work (not the launch), that a throttle stretches the
device time (not only the host's), and that TP collectives inside an op are recorded.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (bench/gpu_check.sh runs it on a GPU machine)")


@pytest.fixture(scope="module")
def nccl1() -> Iterator[torch.device]:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def _matmuls(device: torch.device, n: int = 4096, times: int = 12) -> torch.Tensor:
    a = torch.randn(n, n, device=device) / n ** 0.5
    c = a
    for _ in range(times):
        c = c @ a
    return c


def _timed_op(device: torch.device, factor: float, with_tp: bool = False) -> tuple[list[tuple[str, int, int, float, float]], float]:
    from resihp.trainer_hooks.runtime import tp_layers
    from resihp.trainer_hooks.runtime.chunk_clock import CudaClock
    from resihp.trainer_hooks.runtime.pipeline import ChunkLog, PipelineStep
    from resihp.trainer_hooks.runtime.throttle import Throttle

    step = PipelineStep(None, None, device, Throttle(factor), {})  # type: ignore[arg-type]
    log = ChunkLog(CudaClock(device))

    def forward() -> torch.Tensor:
        c = _matmuls(device)
        if with_tp:
            for _ in range(3):
                tp_layers._timed_all_reduce(c, None)  # the default group: a world of one over NCCL
        return c

    host0 = time.perf_counter()
    step._compute(forward, "F", 0, log)
    host_s = time.perf_counter() - host0
    log.finish()
    return log.chunks, host_s


def _device_s(device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    _matmuls(device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t


def test_an_op_is_timed_by_its_device_work_not_its_launch(nccl1: torch.device) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _timed_op(nccl1, 1.0)  # warm-up: cuBLAS handles, allocator
    chunks, host_s = _timed_op(nccl1, 1.0)
    ((kind, mb, _, s, e),) = chunks
    synced = min(_device_s(nccl1) for _ in range(3))
    assert (kind, mb) == ("F", 0) and 0.0 <= s < e
    assert 0.7 < (e - s) / synced < 1.4, (e - s, synced)  # the kernels' time
    assert host_s < 0.5 * (e - s), (host_s, e - s)  # the host returned before the work was done


def test_a_throttle_stretches_the_device_time(nccl1: torch.device) -> None:
    _timed_op(nccl1, 1.0)
    ((_, _, _, s1, e1),), _ = _timed_op(nccl1, 1.0)
    ((_, _, _, s3, e3),), host_s = _timed_op(nccl1, 3.0)
    assert 2.5 < (e3 - s3) / (e1 - s1) < 3.6, (e1 - s1, e3 - s3)
    assert host_s > 2.0 * (e1 - s1)  # the host waited for the op, then stalled


def test_tp_collectives_inside_an_op_are_a_tp_chunk_ending_with_it(nccl1: torch.device) -> None:
    _timed_op(nccl1, 1.0, with_tp=True)
    chunks, _ = _timed_op(nccl1, 1.0, with_tp=True)
    (f, _, _, fs, fe), (t, mb, _, ts, te) = chunks
    assert (f, t, mb) == ("F", "TP", 0) and te == pytest.approx(fe) and fs <= ts < te


def test_a_runtime_step_on_the_gpu_places_every_chunk_inside_the_step(nccl1: torch.device) -> None:
    from resihp.coordinator.model.plan import Plan
    from resihp.coordinator.model.spec import preset
    from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

    spec = preset("gpt-tiny")
    rt = Runtime(spec, Plan.uniform(1, 1, 1, spec.num_layers, 4), 0, TrainConfig(seed=1, max_seq_len=128),
                 device=nccl1)
    results = [rt.train_step(i) for i in range(4)]
    for r in results:
        kinds = [c[0] for c in r.chunks]
        assert kinds.count("F") == 4 and kinds.count("B") == 4 and kinds[-1] == "OPT", kinds
        assert all(0.0 <= s <= e <= r.time_s + 1e-6 for _, _, _, s, e in r.chunks), r.chunks
        compute = sum(e - s for k, _, _, s, e in r.chunks if k in ("F", "B"))
        assert 0.0 < compute <= r.time_s
    assert results[0].loss is not None
    assert results[-1].loss is not None and results[-1].loss < results[0].loss
