"""The chunk log's placement of marked spans (trainer_hooks/runtime/chunk_clock.py, pipeline.ChunkLog).

On a CPU a mark is a host reading and lands at once; on a GPU it is a CUDA event, placed
only after the device has finished. The placement logic is checked here with a deferred
clock whose marks are numbers (pure logic; the real CUDA events are tests/test_gpu_timing.py,
which bench/gpu_check.sh runs on a GPU machine).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from resihp.trainer_hooks.runtime import tp_layers
from resihp.trainer_hooks.runtime.chunk_clock import HostClock, clock_for
from resihp.trainer_hooks.runtime.pipeline import ChunkLog, PipelineStep
from resihp.trainer_hooks.runtime.throttle import Throttle


class DeferredClock:
    """Marks are numbers, readable only once settled — as CUDA events are after a sync."""

    immediate = False

    def __init__(self) -> None:
        self.t0 = 100.0
        self.now = 100.0
        self.settled = False

    def mark(self) -> float:
        return self.now

    def wait(self, mark: Any) -> None:
        pass

    def settle(self) -> float:
        self.settled = True
        return self.now - self.t0

    def seconds(self, mark: Any) -> float:
        assert self.settled, "a deferred mark was read before the clock settled"
        return float(mark) - self.t0


def test_marked_spans_land_where_they_were_added_once_the_clock_settles() -> None:
    clock = DeferredClock()
    log = ChunkLog(clock)
    log.add_marks("F", 0, 100.0, 100.5)
    log.add("P2P", 1, 100.6, 100.7)  # a host reading (lands at once)
    log.add_marks("F", 1, 100.7, 101.5, inside=[(100.8, 101.0), (101.2, 101.3)])
    log.add_marks("B", 1, 101.5, 102.0)
    assert log.chunks == [("P2P", 1, 0, pytest.approx(0.6), pytest.approx(0.7))]  # the marks wait
    clock.now = 102.25
    assert log.finish() == pytest.approx(2.25)
    assert [c[:3] for c in log.chunks] == [("F", 0, 0), ("P2P", 1, 0), ("F", 1, 0), ("TP", 1, 0), ("B", 1, 0)]
    by = {(k, mb): (s, e) for k, mb, _, s, e in log.chunks}
    assert by[("F", 0)] == pytest.approx((0.0, 0.5)) and by[("B", 1)] == pytest.approx((1.5, 2.0))
    # the TP chunk is the collectives' total (0.2 + 0.1 s), ending where its op ends
    assert by[("TP", 1)] == pytest.approx((1.5 - 0.3, 1.5))
    assert log.finish() == pytest.approx(2.25) and len(log.chunks) == 5  # placed once


def test_a_tp_total_is_kept_inside_its_op() -> None:
    clock = DeferredClock()
    log = ChunkLog(clock)
    log.add_marks("F", 0, 100.0, 100.2, inside=[(99.0, 100.5)])  # more than the op (clock skew)
    log.finish()
    (_, _, _, fs, fe), (_, _, _, ts, te) = log.chunks
    assert (ts, te) == pytest.approx((fs, fe))


def test_host_marks_land_at_once_and_the_step_time_is_the_host_clock() -> None:
    clock = HostClock()
    log = ChunkLog(clock)
    start = clock.mark()
    log.add_marks("DP", -1, start, clock.mark())
    assert [c[0] for c in log.chunks] == ["DP"] and 0.0 <= log.chunks[0][3] <= log.chunks[0][4]
    took = log.finish()
    assert took >= log.chunks[0][4] and log.t0 == clock.t0


def test_a_cpu_device_gets_the_host_clock_and_cuda_is_refused_the_cpu_time_clock() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    with pytest.raises(ValueError, match="a GPU's ops are timed by CUDA events: use compute_clock 'wall'"):
        PipelineStep(None, None, torch.device("cuda", 0), Throttle(), {}, compute_clock="cpu")  # type: ignore[arg-type]


def test_an_op_takes_the_tp_event_pairs_recorded_since_it_began() -> None:
    tp_layers._CUDA_SPANS[:] = [("stale", "left by a failed op")]
    first = tp_layers.cuda_spans_mark()
    tp_layers._CUDA_SPANS.extend([("a0", "a1"), ("b0", "b1")])
    assert tp_layers.take_cuda_spans(first) == [("a0", "a1"), ("b0", "b1")]
    assert tp_layers._CUDA_SPANS == []  # the stale pair went with them
