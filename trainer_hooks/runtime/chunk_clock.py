"""Where a rank's chunk times come from: the host clock on a CPU, CUDA events on a GPU.

Why two clocks: a CUDA op returns to Python as soon as its kernels are queued, so host
timestamps around a forward measure its launch, and the work lands in whatever waits next
(a receive, the loss, the next step). The detector compares each op with what it should
have cost (docs/trace-format.md: F/B/W spans are the op's own kernel time), so on a GPU an
op is timed by two events recorded on the compute stream before and after it. The events
are read once per iteration, after one synchronisation at its end, so timing adds no host
synchronisation per op. They are placed on the host timeline by an anchor event recorded
right after a synchronisation at the iteration's start: the anchor's GPU time is the
host's ``t0``.

A ``ChunkLog`` (pipeline.py) holds marks from its clock: host ``perf_counter`` readings
(``HostClock``) or events (``CudaClock``); ``seconds(mark)`` places one on the iteration's
timeline once the clock has ``settle``d.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class SpanClock(Protocol):
    t0: float  # host perf_counter at the iteration's start
    immediate: bool  # a mark is placed at once (no need to wait for the device)

    def mark(self) -> Any:
        """A point in this rank's work stream, now."""

    def wait(self, mark: Any) -> None:
        """Block the host until the work before ``mark`` is done."""

    def settle(self) -> float:
        """Block until every mark is done; the host's seconds since ``t0`` (the step's time)."""
        ...

    def seconds(self, mark: Any) -> float:
        """Seconds from ``t0`` to ``mark`` (a done mark: after ``wait`` or ``settle``)."""
        ...


class HostClock:
    """CPU ops run on the calling thread: a mark is the host clock."""

    immediate = True

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self, mark: Any) -> None:
        return None

    def settle(self) -> float:
        return time.perf_counter() - self.t0

    def seconds(self, mark: Any) -> float:
        return float(mark) - self.t0


class CudaClock:
    """GPU ops run on the device's current stream: a mark is an event recorded on it."""

    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)  # the previous step's work is done: the anchor runs now
        self.t0 = time.perf_counter()
        self.anchor = self.mark()

    def mark(self) -> Any:
        return cuda_mark()

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def settle(self) -> float:
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def seconds(self, mark: Any) -> float:
        return float(self.anchor.elapsed_time(mark)) / 1000.0  # elapsed_time is in ms


def cuda_mark() -> Any:
    """A timing event recorded on the current CUDA stream, now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def clock_for(device: torch.device) -> SpanClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()
