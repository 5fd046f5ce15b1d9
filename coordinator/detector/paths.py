"""Which ranks a slow pipeline path is evidence against (the judge's link evidence).

A rank's link score is the smallest ratio over its cross-node P2P directions (in and out,
to the previous and the next stage): a slow NIC slows every direction of its rank, while a
neighbour is slow only in those that touch the culprit. Two cases that rule misreads:

- a pipeline end has one neighbour, so both ends of a slow link look alike
  (``pipeline_end_culprit``);
- a slow *path* between two middle stages shows in one of each end's two paths only, which
  the smallest ratio reads as healthy (``slow_path``).

Paths inside a node are evidence too (a degraded NVLink or PCIe link between two stages of
one node), but only where they are quiet when healthy (``QuietPaths``): on shared CPU cores
and loopback a healthy transfer inside a "node" read 1.5-5x its model for iterations on end,
and every healthy real run was accused.

Pure (numpy only).
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.evidence import PlanIndex
from resihp.coordinator.detector.ratios import fill_nan

FloatArray = npt.NDArray[np.float64]

# a path between two stages reads at least this slow (both of its transfers) before its two
# ends are judged on it
PATH_SLOW = 1.25


def slow_path(dirs: FloatArray, ix: PlanIndex, comm_threshold: float, cross: FloatArray | None = None) -> FloatArray:
    """Per rank, the ratio of a slow path to a neighbouring stage that only that path
    explains (NaN elsewhere). ``dirs``: (4, n) ratios in from the previous stage, in from the
    next, out to the next, out to the previous (NaN where there is none). A path's two
    transfers (the activation one way, the gradient the other) are read by its two ends; it
    counts when both read at least ``PATH_SLOW`` x and neither end is slow on all its
    cross-node paths (a NIC: its own finding; ``cross``: ``dirs`` with NaN where a transfer
    stays inside its node, ``dirs`` itself when None). Paths inside a node count as well: a
    degraded NVLink or PCIe link between two stages of one node was never found before
    (bench/outsider_traces.py, 2026-12-07). Before that, a slow path between two middle
    stages was never found either."""
    bar = 1.0 + max(comm_threshold, PATH_SLOW - 1.0)

    def sides(d: FloatArray) -> tuple[FloatArray, FloatArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        prev, nxt = np.fmin(d[0], d[3]), np.fmin(d[1], d[2])
        return prev, nxt, fill_nan(prev, 0.0) > bar, fill_nan(nxt, 0.0) > bar

    prev, nxt, hot_p, hot_n = sides(dirs)
    _, _, nic_p, nic_n = sides(dirs if cross is None else cross)
    c = dirs if cross is None else cross
    has_p, has_n = np.isfinite(np.fmin(c[0], c[3])), np.isfinite(np.fmin(c[1], c[2]))
    every = (nic_p | ~has_p) & (nic_n | ~has_n) & (has_p | has_n)  # slow on all its cross-node paths
    to_n = np.where(ix.fwd_recv >= 0, ix.fwd_recv, 0)
    to_p = np.where(ix.bwd_recv >= 0, ix.bwd_recv, 0)
    path_n = hot_n & ~every & (ix.fwd_recv >= 0) & ~every[to_n]
    path_p = hot_p & ~every & (ix.bwd_recv >= 0) & ~every[to_p]
    out: FloatArray = np.fmax(np.where(path_n, nxt, np.nan), np.where(path_p, prev, np.nan))
    return out


def pipeline_end_culprit(comm: FloatArray, link: FloatArray, dp_ratio: FloatArray, ix: PlanIndex,
                         comm_threshold: float, adaptive: bool) -> FloatArray:
    """``comm`` with the evidence taken off the innocent end of a slow link whose two ends
    both read slow. The culprit's DP ring is slow too (a NIC carries both), the neighbour's
    is not. Where neither ring is slow by half the link's slowdown, the path between the two
    stages is (its rings untouched): the adaptive test keeps the evidence on both ends.
    (Ranked by two healthy rings' noise, the end that kept it changed from one iteration to
    the next, and a 5x path costing 70 % of the iteration took 7-17 iterations to find.)
    Fixed thresholds learn no spread: there the rings' ranking stays, as extra persistence
    against bursts that hit both ends of a link on shared hosts
    (tests/test_detector_real_link_trace.py: 10x for 3 iterations, healthy)."""
    hot = fill_nan(link, 0.0) > 1.0 + comm_threshold
    ring_or_1 = fill_nan(dp_ratio, 1.0)
    link_or_1 = fill_nan(link, 1.0)
    for nbr, cross in ((ix.fwd_recv, ix.cross_fwd), (ix.bwd_recv, ix.cross_bwd)):
        q = np.where(nbr >= 0, nbr, 0)
        lose = cross & (nbr >= 0) & hot & hot[q] & (ring_or_1 < ring_or_1[q])
        if adaptive:
            ring_excess = np.maximum(ring_or_1, ring_or_1[q]) - 1.0
            lose &= ring_excess >= 0.5 * (np.minimum(link_or_1, link_or_1[q]) - 1.0)
        comm = np.where(lose, 1.0, comm)
    return comm


class QuietPaths:
    """Per rank, whether its paths inside its node are quiet when healthy: over its latest
    ``WINDOW`` healthy iterations (at least half of them seen), no more than ``LOUD`` of its
    readings (the slower of its intra-node paths, each read as the smaller of its two
    transfers) above the path bar. A reading waits ``DELAY`` iterations and is kept only if
    its rank is still healthy then: a slow path's first iterations must not close its own
    gate before it is found. A plan change moves ranks: the window starts again."""

    WINDOW = 64
    LOUD = 0.05
    DELAY = 8

    def __init__(self, ix: PlanIndex, comm_threshold: float) -> None:
        n = ix.n
        self._bar = 1.0 + max(comm_threshold, PATH_SLOW - 1.0)
        self._prev_in = (ix.bwd_recv >= 0) & ~ix.cross_bwd  # a path to the previous stage inside the node
        self._next_in = (ix.fwd_recv >= 0) & ~ix.cross_fwd
        # no path inside a node at all (every stage boundary crosses nodes): nothing to judge or keep
        self.any = bool((self._prev_in | self._next_in).any())
        # per window slot and rank: 1 a reading at or below the bar, 2 above it, 0 none; the
        # counts follow each push (a window scan per iteration cost ~1 ms at 4096 ranks)
        self.hist = np.zeros((self.WINDOW, n), dtype=np.int8)
        self.pending = np.full((self.DELAY, n), np.nan)
        self.seen = np.zeros(n, dtype=np.int64)
        self.loud = np.zeros(n, dtype=np.int64)
        self.pos = 0

    def push(self, dirs: FloatArray, healthy: npt.NDArray[np.bool_]) -> None:
        """This iteration's (4, n) directional ratios (as ``slow_path`` takes them); ``healthy``:
        the ranks healthy now (their reading of ``DELAY`` iterations ago is kept)."""
        prev = np.where(self._prev_in, np.fmin(dirs[0], dirs[3]), np.nan)
        nxt = np.where(self._next_in, np.fmin(dirs[1], dirs[2]), np.nan)
        slot = self.pos % self.DELAY
        if self.pos >= self.DELAY:
            old = self.hist[(self.pos - self.DELAY) % self.WINDOW]
            self.seen -= old > 0
            self.loud -= old > 1
            kept = np.where(healthy, self.pending[slot], np.nan)
            new = np.where(np.isfinite(kept), np.where(fill_nan(kept, 0.0) > self._bar, 2, 1), 0).astype(np.int8)
            old[:] = new
            self.seen += new > 0
            self.loud += new > 1
        self.pending[slot] = np.where(healthy, np.fmax(prev, nxt), np.nan)
        self.pos += 1

    def quiet(self) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = (self.seen >= self.WINDOW // 2) & (self.loud <= self.LOUD * np.maximum(self.seen, 1))
        return out


def path_evidence(dirs: FloatArray, every_dir: FloatArray, ix: PlanIndex, comm_threshold: float,
                  quiet: QuietPaths, healthy: npt.NDArray[np.bool_]) -> FloatArray:
    """Per rank, the ratio of a slow path it is an end of (NaN elsewhere): across nodes from
    ``dirs`` (NaN where a transfer stays inside its node), inside a node from ``every_dir``
    where ``quiet`` shows such paths quiet; then this iteration's readings teach ``quiet``
    (``healthy``: the ranks healthy now)."""
    path = slow_path(dirs, ix, comm_threshold)
    if quiet.any:
        ok = quiet.quiet()
        if ok.any():
            path = np.fmax(path, np.where(ok, slow_path(every_dir, ix, comm_threshold, cross=dirs), np.nan))
        quiet.push(every_dir, healthy)
    return path


def rings_outside_slow_nics(ring: npt.NDArray[np.bool_], nic: npt.NDArray[np.bool_],
                            ix: PlanIndex) -> npt.NDArray[np.bool_]:
    """Of the members of slow DP rings (``ring``: ranks whose P2P stays inside their node),
    those on a node that a slow NIC does not explain, in rings where some member's node has
    one (``nic``: ranks found link-slow on their own cross-node transfers). A slow NIC slows
    every ring through its node; a ring's members look alike, but the node whose NIC also
    slows its P2P is the culprit's (a 4x NIC of a 4-GPU node named the other node's ring
    members with it, bench/outsider_traces.py)."""
    nic = nic & (ix.node_id >= 0)
    if not nic.any():
        return np.zeros_like(ring)
    slow_node = np.zeros(int(ix.node_id.max()) + 1, dtype=np.bool_)
    slow_node[ix.node_id[nic]] = True
    on = (ix.node_id >= 0) & slow_node[np.maximum(ix.node_id, 0)]
    out: npt.NDArray[np.bool_] = ring & np.isin(ix.ring, ix.ring[on]) & ~on
    return out


__all__ = ["PATH_SLOW", "QuietPaths", "path_evidence", "pipeline_end_culprit", "rings_outside_slow_nics",
           "slow_path"]
