"""The recent window a fixed-threshold recovery of a link-slow rank is judged on. Pure.

On shared cores every ratio a link-slow rank recovers on has a heavy tail (P2P 1-11x, a DP
ring 0-9.8x, compute 1-2.7x per iteration): requiring all three within their thresholds in
``recover_iters`` consecutive iterations held a rank whose shaper was gone for 14-65
iterations. So each is read as the median of the rank's last 2·recover_iters − 1 iterations
(most of the window must be back: a slow NIC keeps every iteration far out), and its ring is
judged against its own healthy level (one ring's all-reduce read 1.8-2.9x the model for a
whole healthy run: its rank's own entry skew). docs/detector.md, state table.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.ratios import nanmedian

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class RecoveryWindow:
    """The last ``window`` iterations' compute, link and DP-ring ratios of every rank of one
    plan, and each rank's healthy ring level."""

    def __init__(self, window: int, n: int) -> None:
        self.window = window
        self._history = np.full((window, n, 3), np.nan)
        self._turn = 0
        # a rank's ring median in the iteration it turned suspect (healthy before it; the one
        # slow iteration in the window moves no median). Taken at that turn only: every healthy
        # rank's median in every iteration cost 0.35 ms at 4,096 ranks. NaN: none yet
        self.ring_level = np.full(n, np.nan)

    def fits(self, window: int, n: int) -> bool:
        return self._history.shape == (window, n, 3)

    def push(self, comp: FloatArray, comm: FloatArray, dp_ratio: FloatArray, link_slow: BoolArray,
             turning: BoolArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Add this iteration (``turning``: ranks healthy until this iteration and suspect in
        it); return the compute, link and ring ratios to judge: this iteration's, and the
        window's medians for the link-slow ranks."""
        now = np.stack([comp, comm, dp_ratio], axis=1)
        h = self._history
        h[self._turn % self.window] = now
        self._turn += 1
        if turning.any():
            self.ring_level[turning] = nanmedian(h[:, turning, 2], axis=0)
        rows = np.nonzero(link_slow)[0]
        if len(rows):
            now[rows] = nanmedian(h[:, rows, :], axis=0)
        return now[:, 0], now[:, 1], now[:, 2]

    def ring_back_below(self, dp_threshold: float) -> FloatArray:
        """(n,) the ring ratio a link-slow rank's ring is back under: 1 + dp_threshold above
        its own healthy level where that is above the model."""
        out: FloatArray = (1 + dp_threshold) * np.fmax(1.0, self.ring_level)
        return out
