"""Micro-batch cost: FLOPs of a transformer chunk on packed sequences, and robust calibration.

Pure: numpy only, deterministic.

FLOP formulas (matmul FLOPs only; norms, softmax, activations and residual adds are cheap
element-wise work that the calibrated constant term absorbs). A matmul [t,k]x[k,n] costs
2·t·k·n forward. Notation for ONE transformer layer on ONE tensor-parallel shard, for one
micro-batch of packed documents of lengths l_i:

    t  = Σ l_i (tokens)            S = Σ l_i² (attention is masked per document)
    h  = hidden, a = heads, g = kv heads, d = h / a, f = ffn_hidden, k = 3 if SwiGLU else 2
    P  = h·(h + 2·g·d) + h·h + k·h·f          (matmul weights: QKV, out-proj, MLP)

    linear    L = 2·t·P / tp
    attention A = 2·h·S / tp    (QKᵀ and A·V, 2·l²·h each per document, halved by the causal mask)

    F = L + A        B = L + 2·A        W = L

B (gradient w.r.t. inputs) redoes every weight matmul once and both attention matmuls
twice (grads of Q and K from the scores, of the probabilities and V from A·V); W
(gradient w.r.t. weights) redoes every weight matmul once and has no attention term.
So F + B + W = 6·t·P/tp + 6·h·S/tp: the 6·params·tokens rule plus the quadratic part.

LM head (last stage): 2·t·h·vocab/tp each for F, B and W. Input embedding (first stage):
a gather, no matmul FLOPs.

Calibration fits T = α·tokens + β·Σl² + γ (seconds) per key from healthy samples with a
robust, non-negative, relative-error regression (see ``fit_linear_cost``).
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from resihp.coordinator.model.spec import ModelSpec, SpecError

FloatArray = npt.NDArray[np.float64]
FloatSeq = Sequence[float] | FloatArray


@dataclass(frozen=True)
class ChunkFlops:
    f: float  # forward FLOPs
    b: float  # backward w.r.t. activations (input grad)
    w: float  # backward w.r.t. weights

    @property
    def total(self) -> float:
        return self.f + self.b + self.w

    def __add__(self, other: ChunkFlops) -> ChunkFlops:
        return ChunkFlops(self.f + other.f, self.b + other.b, self.w + other.w)

    def scale(self, k: float) -> ChunkFlops:
        return ChunkFlops(self.f * k, self.b * k, self.w * k)


def features(seqlens: Sequence[int]) -> tuple[float, float]:
    """(tokens, sum of squared packed-document lengths) of one micro-batch."""
    tokens = 0.0
    sum_sq = 0.0
    for length in seqlens:
        x = float(length)
        if not x >= 0.0 or math.isinf(x):  # also catches NaN
            raise ValueError(f"sequence lengths must be finite and >= 0, got {length!r} in {list(seqlens)[:8]}")
        tokens += x
        sum_sq += x * x
    return tokens, sum_sq


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or spec.num_heads % tp:
        raise SpecError(
            f"tp must be a positive integer dividing num_heads ({spec.num_heads}) of {spec.name!r}, got {tp!r}"
        )


def matmul_params_per_layer(spec: ModelSpec) -> int:
    """Weights of one layer that take part in matmuls (P above: no norm weights)."""
    h = spec.hidden
    kv_dim = spec.kv_heads * spec.head_dim
    mlp = (3 if spec.gated_mlp else 2) * h * spec.ffn_hidden
    return int(h * (h + 2 * kv_dim) + h * h + mlp)


def layer_flops(spec: ModelSpec, seqlens: Sequence[int], tp: int = 1) -> ChunkFlops:
    """FLOPs of ONE transformer layer on ONE TP shard (1/tp of the matmuls and heads) for one
    micro-batch of packed documents: linear terms in tokens + causal attention quadratic in
    each document's length (attention is masked per document). Formulas: module docstring."""
    _check_tp(spec, tp)
    tokens, sum_sq = features(seqlens)
    linear = 2.0 * tokens * matmul_params_per_layer(spec) / tp
    attention = 2.0 * spec.hidden * sum_sq / tp
    return ChunkFlops(f=linear + attention, b=linear + 2.0 * attention, w=linear)


def embedding_flops(spec: ModelSpec, seqlens: Sequence[int], tp: int = 1) -> ChunkFlops:
    """Input embedding (first stage): a gather and a scatter-add, no matmul FLOPs."""
    _check_tp(spec, tp)
    features(seqlens)  # validate
    return ChunkFlops(0.0, 0.0, 0.0)


def head_flops(spec: ModelSpec, seqlens: Sequence[int], tp: int = 1) -> ChunkFlops:
    """Final norm + LM head + loss (last stage): the vocab projection, vocab split over TP."""
    _check_tp(spec, tp)
    tokens, _ = features(seqlens)
    proj = 2.0 * tokens * spec.hidden * spec.vocab / tp
    return ChunkFlops(proj, proj, proj)


def stage_flops(
    spec: ModelSpec,
    seqlens: Sequence[int],
    num_layers: int,
    tp: int = 1,
    first: bool = False,
    last: bool = False,
) -> ChunkFlops:
    """FLOPs of one pipeline (virtual) stage holding ``num_layers`` layers on one TP shard."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
        raise SpecError(f"num_layers must be an integer >= 0, got {num_layers!r}")
    out = layer_flops(spec, seqlens, tp).scale(float(num_layers))
    if first:
        out = out + embedding_flops(spec, seqlens, tp)
    if last:
        out = out + head_flops(spec, seqlens, tp)
    return out


# --- calibration ----------------------------------------------------------------------


@dataclass(frozen=True)
class LinearCost:
    """T = alpha*tokens + beta*sum_sq + gamma (seconds)."""

    alpha: float
    beta: float
    gamma: float

    def predict(self, tokens: float, sum_sq: float) -> float:
        return self.alpha * tokens + self.beta * sum_sq + self.gamma

    def predict_seqlens(self, seqlens: Sequence[int]) -> float:
        return self.predict(*features(seqlens))


_TUKEY_C = 4.685  # 95 % efficiency under Gaussian noise
_TRIM_KEEP = 0.75  # fraction kept by the trimmed start (tolerates up to 25 % outliers)


def _nnls_small(x: FloatArray, y: FloatArray, w: FloatArray) -> FloatArray:
    """Weighted least squares with c >= 0 over <= 3 columns: best feasible active set."""
    sw = np.sqrt(w)
    xs = x * sw[:, None]
    ys = y * sw
    ncol = x.shape[1]
    best = np.zeros(ncol)
    best_sse = float(np.dot(ys, ys))
    for size in range(ncol, 0, -1):
        for cols in itertools.combinations(range(ncol), size):
            sub = xs[:, cols]
            coef, *_ = np.linalg.lstsq(sub, ys, rcond=None)
            if np.any(coef < 0.0):
                continue
            if size == ncol:
                # feasible unconstrained optimum: no subset can fit better, skip their solves
                return np.asarray(coef, dtype=np.float64)
            resid = ys - sub @ coef
            sse = float(np.dot(resid, resid))
            if sse < best_sse * (1.0 - 1e-12):
                best_sse = sse
                best = np.zeros(ncol)
                best[list(cols)] = coef
    return best


def fit_linear_cost(tokens: FloatSeq, sum_sq: FloatSeq, times: FloatSeq) -> LinearCost:
    """Robust fit (outliers such as GC pauses must not drag it), non-negative coefficients.

    Minimises relative error (timings of big and small micro-batches count alike):
    1. trimmed start: least squares, then three concentration steps on the 75 % of samples
       with the smallest relative residuals (breakdown point 25 %);
    2. Tukey-biweight IRLS (c = 4.685 · MAD scale of relative residuals) from that start.
    Each solve is a non-negative weighted least squares over (tokens, Σl², 1).
    """
    x1 = np.asarray(tokens, dtype=np.float64)
    x2 = np.asarray(sum_sq, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if not (x1.ndim == x2.ndim == y.ndim == 1) or not (len(x1) == len(x2) == len(y)):
        raise ValueError(
            f"fit_linear_cost: tokens, sum_sq and times must be flat sequences of equal length, "
            f"got {x1.shape}, {x2.shape}, {y.shape}"
        )
    if len(y) == 0:
        raise ValueError("fit_linear_cost: no samples; add healthy timings first")
    for name, arr in (("tokens", x1), ("sum_sq", x2)):
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"fit_linear_cost: {name} must be finite and >= 0")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        bad = int(np.argmax(~np.isfinite(y) | (y <= 0)))
        raise ValueError(f"fit_linear_cost: times must be finite and > 0 seconds; sample {bad} is {float(y[bad])!r}")

    # scale columns to O(1) so the small solves are well conditioned
    s1 = float(x1.max()) or 1.0
    s2 = float(x2.max()) or 1.0
    x = np.column_stack([x1 / s1, x2 / s2, np.ones_like(y)])
    base_w = 1.0 / (y * y)  # relative error

    coef = _nnls_small(x, y, base_w)
    n = len(y)
    keep = max(int(math.ceil(_TRIM_KEEP * n)), min(n, 3))
    if keep < n:
        for _ in range(3):
            rel = np.abs(y - x @ coef) / y
            idx = np.argsort(rel, kind="stable")[:keep]
            coef = _nnls_small(x[idx], y[idx], base_w[idx])

    for _ in range(30):
        rel = (y - x @ coef) / y
        scale = 1.4826 * float(np.median(np.abs(rel)))
        scale = max(scale, 1e-9)
        u = rel / (_TUKEY_C * scale)
        tukey = np.where(np.abs(u) < 1.0, (1.0 - u * u) ** 2, 0.0)
        if np.count_nonzero(tukey) < min(n, 3):
            break
        new = _nnls_small(x, y, base_w * tukey)
        done = bool(np.allclose(new, coef, rtol=1e-10, atol=1e-15))
        coef = new
        if done:
            break
    return LinearCost(alpha=float(coef[0]) / s1, beta=float(coef[1]) / s2, gamma=float(coef[2]))


class Calibrator:
    """Online calibration from healthy iterations, one LinearCost per key (e.g. (stage, "F")).
    Bounded memory (a window of recent samples per key); refits lazily."""

    def __init__(self, window: int = 256, min_samples: int = 8) -> None:
        if window < 3 or min_samples < 3 or min_samples > window:
            raise ValueError(
                f"Calibrator: need 3 <= min_samples <= window, got window={window}, min_samples={min_samples}"
            )
        self.window = window
        self.min_samples = min_samples
        self._samples: dict[Hashable, deque[tuple[float, float, float]]] = {}
        self._models: dict[Hashable, LinearCost] = {}

    def add(self, key: Hashable, seqlens: Sequence[int], time_s: float) -> None:
        tokens, sum_sq = features(seqlens)
        self.add_features(key, tokens, sum_sq, time_s)

    def add_features(self, key: Hashable, tokens: float, sum_sq: float, time_s: float) -> None:
        """Like ``add`` when the caller already has (tokens, Σl²)."""
        t = float(time_s)
        if not (math.isfinite(t) and t > 0.0):
            raise ValueError(f"Calibrator.add: time_s must be finite and > 0 seconds, got {time_s!r} for {key!r}")
        if not (math.isfinite(tokens) and tokens >= 0 and math.isfinite(sum_sq) and sum_sq >= 0):
            raise ValueError(f"Calibrator.add: features must be finite and >= 0, got {tokens!r}, {sum_sq!r}")
        buf = self._samples.get(key)
        if buf is None:
            buf = self._samples[key] = deque(maxlen=self.window)
        buf.append((float(tokens), float(sum_sq), t))
        self._models.pop(key, None)  # stale: refit on next use

    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._samples)

    def samples(self, key: Hashable) -> int:
        buf = self._samples.get(key)
        return 0 if buf is None else len(buf)

    def ready(self, key: Hashable) -> bool:
        return self.samples(key) >= self.min_samples

    def samples_of(self, key: Hashable) -> list[tuple[float, float, float]]:
        """The window's (tokens, Σl², seconds) samples of ``key`` (empty if never seen)."""
        return list(self._samples.get(key, ()))

    def model(self, key: Hashable) -> LinearCost:
        """The fitted cost of ``key``; KeyError if never seen, ValueError if too few samples."""
        cached = self._models.get(key)
        if cached is not None:
            return cached
        if key not in self._samples:
            raise KeyError(f"Calibrator: no samples for {key!r}; known keys: {list(self._samples)[:10]}")
        buf = self._samples[key]
        if len(buf) < self.min_samples:
            raise ValueError(
                f"Calibrator: {key!r} has {len(buf)} samples, needs {self.min_samples} before it can predict"
            )
        arr = np.asarray(buf, dtype=np.float64)
        fitted = fit_linear_cost(arr[:, 0], arr[:, 1], arr[:, 2])
        self._models[key] = fitted
        return fitted

    def predict(self, key: Hashable, seqlens: Sequence[int]) -> float:
        return self.model(key).predict_seqlens(seqlens)

    def reset(self, key: Hashable) -> None:
        """Forget a key (e.g. after a reconfiguration changed what it measures)."""
        self._samples.pop(key, None)
        self._models.pop(key, None)
