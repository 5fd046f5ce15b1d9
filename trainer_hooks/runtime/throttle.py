"""A real throttle of one rank's compute, for fail-slow injection.

What it is: after every compute chunk (a micro-batch's forward or backward) the rank
stalls for ``(factor − 1) ×`` the chunk's measured duration, so its compute really takes
``factor ×`` as long in wall time and everything downstream (pipeline peers, the DP
all-reduce) waits for it, exactly as behind a GPU whose clock dropped. Communication is
not slowed. ``mode="sleep"`` stalls without using the CPU (a slow accelerator does not load
the host); ``mode="spin"`` busy-waits on ``clock``, which also takes a core from co-located
ranks — with ``clock=time.thread_time`` it burns exactly (factor − 1) × the chunk's CPU time,
once the throttle to pair with CPU-time chunk timings; now the CPU clock (the default on
CPU devices) adds the stall to the op's recorded CPU time itself, as a slow device's op
time would hold it, and the default sleep leaves the core to co-located ranks.
The chunk timings the runtime records include the stall, so the detector sees it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    def __init__(self, factor: float = 1.0, mode: str = "sleep", clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = threading.Lock()
        self._factor = 1.0
        self.mode = mode
        self._clock = clock
        if mode not in ("sleep", "spin"):
            raise ValueError(f"throttle mode must be 'sleep' or 'spin', got {mode!r}")
        self.set_factor(factor)

    @property
    def factor(self) -> float:
        with self._lock:
            return self._factor

    def set_factor(self, factor: float) -> None:
        if not factor >= 1.0:
            raise ValueError(f"throttle factor must be >= 1 (1 = full speed), got {factor!r}")
        with self._lock:
            self._factor = float(factor)

    def stall_for(self, elapsed_s: float) -> float:
        """Stall (factor − 1) × elapsed_s; returns the stall taken."""
        extra = (self.factor - 1.0) * max(0.0, elapsed_s)
        if extra <= 0.0:
            return 0.0
        if self.mode == "sleep":
            time.sleep(extra)
        else:
            deadline = self._clock() + extra
            while self._clock() < deadline:
                pass
        return extra
