"""An idle rank's compute probe: a fixed few GEMMs on its device, timed like its compute.

Why: a rank the plan leaves idle (a spare, or one excluded for being slow) runs no
iteration, so nothing tells the detector whether its device is still slow or has
recovered, or whether a healthy spare went slow. Every rank probes once at start-up (the
healthy reference, judged against the other ranks') and an idle rank again every
``probe_every_s``; the coordinator's detector judges the probes (coordinator/
coordinator/detector/probe.py).

What it measures: the best of ``rounds`` timings of ``repeats`` matrix products of
``size`` × ``size`` — on a GPU in wall time after a device synchronisation, on a CPU in the
calling thread's CPU time with one torch thread (the time other ranks sharing the cores
take is not the probed device's slowness). The rank's throttle (fault injection) stretches
each round as it stretches a compute chunk, and the stall counts, so an injected fail-slow
shows in the probe exactly as in the rank's steps.
"""
from __future__ import annotations

import time

import torch

from resihp.trainer_hooks.runtime.throttle import Throttle

CPU_SHAPE = (256, 24)  # (size, repeats): ~0.8 GFLOP, some tens of ms on one core
GPU_SHAPE = (4096, 8)  # ~1.1 TFLOP: a few ms on a current GPU, long enough to read its clock


class ComputeProbe:
    def __init__(self, device: torch.device, throttle: Throttle, rounds: int = 3, seed: int = 0) -> None:
        if rounds < 1:
            raise ValueError(f"probe rounds must be >= 1, got {rounds}")
        self.device = device
        self.throttle = throttle
        self.rounds = rounds
        self.size, self.repeats = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
        self.seed = seed
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        self._warm = False

    def _operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrices, on the device only while probing: a GPU's 192 MB (operands and
        product) go back to training, a CPU's 0.5 MB are kept."""
        if self._a is not None and self._b is not None:
            return self._a, self._b
        gen = torch.Generator().manual_seed(self.seed)
        a = torch.randn(self.size, self.size, generator=gen) / self.size ** 0.5
        pair = a.to(self.device), a.t().contiguous().to(self.device)
        if self.device.type == "cpu":
            self._a, self._b = pair
        return pair

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _work(self, a: torch.Tensor, b: torch.Tensor) -> None:
        c = a
        for _ in range(self.repeats):
            c = torch.mm(c, b)
        self._sync()

    def _round(self, a: torch.Tensor, b: torch.Tensor) -> float:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        self._work(a, b)
        took = (time.thread_time() - cpu0) if self.device.type == "cpu" else (time.perf_counter() - wall0)
        return took + self.throttle.stall_for(took)

    def run(self) -> float:
        """The probe's duration in seconds (> 0)."""
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # thread_time sees the calling thread only
        try:
            with torch.no_grad():
                a, b = self._operands()
                if not self._warm:  # first use: allocation and kernel selection are not the device's speed
                    self._work(a, b)
                    self._warm = True
                best = min(self._round(a, b) for _ in range(self.rounds))
                del a, b
        finally:
            if self.device.type == "cpu":
                torch.set_num_threads(threads)
        return max(best, 1e-9)
