"""Robust per-rank ratios of observed to predicted times, and the NaN-aware reductions the
detector uses on them.

A rank's evidence is many timed entries (ops, transfers) against their predictions; these
turn them into one ratio per rank that one OS hiccup or one congested transfer cannot move
(``trimmed_ratio``), or that reads the device through the scheduler's stretches on shared
cores (``floor_ratio``). Vectorised over ranks, single precision where three digits do.

Pure (numpy only).
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def nanmedian(x: FloatArray, axis: int) -> FloatArray:
    """Median along ``axis`` ignoring NaN (NaN where a slice has no value). A sort puts the
    NaNs last, so the median sits at the middle of each slice's finite prefix; this is
    several times faster than numpy's nanmedian on many short slices."""
    moved = np.moveaxis(x, axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    srt = np.sort(flat, axis=1)
    n = np.isfinite(flat).sum(axis=1)
    lo = np.maximum((n - 1) // 2, 0)
    hi = np.maximum(n // 2, 0)
    rows = np.arange(len(srt))
    med = 0.5 * (srt[rows, lo] + srt[rows, hi])
    med[n == 0] = np.nan
    out: FloatArray = med.reshape(moved.shape[:-1])
    return out


def median(x: FloatArray) -> float:
    """``float(np.median(x))`` of a 1-d array without NaN, the same value (a partition, then
    the mean of the middle one or two) without np.median's generic machinery."""
    n = len(x)
    h = n // 2
    if n % 2:
        return float(np.partition(x, h)[h])
    part = np.partition(x, [h - 1, h])
    return float((part[h - 1] + part[h]) / 2.0)


def fill_nan(x: FloatArray, value: float) -> FloatArray:
    """A copy of x with NaN replaced (cheaper than nan_to_num, which also scans for inf)."""
    out = np.array(x, dtype=np.float64)
    np.copyto(out, value, where=np.isnan(out))
    return out


def priced_ratio(obs: FloatArray, pred: FloatArray) -> FloatArray:
    """``obs / pred``, NaN where nothing is predicted yet (``pred`` <= 0: a DP ring not priced
    just after a plan change), rather than an infinite ratio."""
    out = np.full(np.shape(obs), np.nan)
    np.divide(obs, pred, out=out, where=pred > 0)
    return out


def trimmed_ratio(obs: FloatArray, pred: FloatArray, rows: IntArray | None = None,
                  parts: int | None = None) -> FloatArray:
    """Per row (rank): Σ observed / Σ predicted over its timed entries, after taking off
    the largest excess of any one entry over the row's own ratio. As a ratio of sums
    each op weighs what it costs, so a launch-bound tiny micro-batch (hard to predict,
    cheap) cannot move it; taking off the worst excess means one OS hiccup or one
    congested transfer cannot either, while a slow device, slow in every op, still shows
    in full. NaN where a row has no entry. ``rows``: ``pred`` holds one row per TP group
    and row i of ``obs`` is predicted by ``pred[rows[i]]`` (members share a prediction).
    ``parts``: an axis (after the first) whose entries are judged apart, e.g. the two
    directions of P2P: then one ratio per (entry, row), (parts, n), in one pass.

    Row sums are matrix-vector products (one per part, each on its own contiguous rows)
    and the row max runs over the transpose: numpy's reductions along a short row axis
    are several times slower."""
    n = obs.shape[0]
    idx: IntArray = np.arange(n) if rows is None else rows
    if rows is None:
        pred = np.broadcast_to(pred, obs.shape)
    # (parts, rows, entries); single precision: ratios need 3 digits, and half the bytes is
    # half the time here. The groups' predictions are converted, then gathered (take: several
    # times faster than [rows] here)
    # (C order: the row sums must see contiguous rows, as BLAS sums a strided matrix otherwise)
    if parts is None:
        o = np.array(obs.reshape(1, n, -1), dtype=np.float32, order="C")
        pg = np.asarray(pred.reshape(1, len(pred), -1), dtype=np.float32)
    else:
        o = np.array(np.moveaxis(obs, parts, 0).reshape(obs.shape[parts], n, -1), dtype=np.float32, order="C")
        pg = np.asarray(np.moveaxis(pred, parts, 0).reshape(pred.shape[parts], len(pred), -1), dtype=np.float32)
    p = np.take(pg, idx, axis=1)  # a new C-ordered array
    miss = np.isnan(o)
    miss |= np.isnan(p)
    if miss.any():
        np.copyto(o, 0.0, where=miss)
        np.copyto(p, 0.0, where=miss)
    k = o.shape[2]
    ones = np.ones(k, dtype=np.float32)
    so = np.stack([part @ ones for part in o])
    sp = np.stack([part @ ones for part in p])
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = so / sp
        # the one op furthest above the row's own ratio: a uniformly slow device has none
        np.multiply(p, rho[:, :, None], out=p)
        np.subtract(o, p, out=p)
        worst = np.maximum(np.max(np.ascontiguousarray(np.moveaxis(p, 2, 0)), axis=0), 0.0)
    # timed entries per row (a matrix-vector product again: count_nonzero along rows is slower)
    count = k - (miss.reshape(-1, k).astype(np.float32) @ ones).reshape(miss.shape[:2])
    so = so - np.where(count > 1, _nan_to_num32(worst), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out: FloatArray = np.where(count > 0, so / sp, np.nan).astype(np.float64)
    return out[0] if parts is None else out


def floor_ratio(obs: FloatArray, pred: FloatArray, rows: IntArray | None = None, share: float = 0.5) -> FloatArray:
    """Per row (rank): the smallest observed / predicted ratio of its timed entries among those
    predicted to cost at least ``share`` of the row's mean predicted entry (a launch-bound
    tiny op says little). Where a rank shares cores, the scheduler stretches most of its ops
    by whatever it was descheduled for, but never shrinks one: the least stretched op is the
    device's own speed, and a slow device is slow in that one too. NaN where a row has no
    such entry. ``rows`` as in ``trimmed_ratio``.

    Single precision, the entry mask and reciprocals worked out once per prediction row (a
    TP group's members share it), the minimum taken over the transpose (see trimmed_ratio)."""
    n = obs.shape[0]
    pg = np.asarray(pred.reshape(len(pred), -1), dtype=np.float32)
    has = np.isfinite(pg)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(has, pg, np.float32(0.0)).sum(axis=1, keepdims=True) / has.sum(axis=1, keepdims=True)
        inv = np.where(has & (pg >= share * mean) & (pg > 0), np.float32(1.0) / pg, np.float32(np.nan))
    if rows is not None:
        inv = np.take(inv, rows, axis=0)
    if inv.shape[1] == 0:  # no entries at all
        return np.full(n, np.nan)
    r = np.asarray(obs.reshape(n, -1), dtype=np.float32) * inv
    low: FloatArray = np.fmin.reduce(np.ascontiguousarray(r.T), axis=0).astype(np.float64)
    return low


_F32 = np.finfo(np.float32)


def _nan_to_num32(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``np.nan_to_num`` of a float32 array (NaN 0, ±inf the largest finite), without its
    Python-level checks, which cost more than the work on a few thousand values."""
    out = np.where(np.isnan(x), np.float32(0.0), x)
    np.clip(out, _F32.min, _F32.max, out=out)
    return out
