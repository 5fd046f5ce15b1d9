"""Cost model: FLOP formulas on packed sequences and robust online calibration."""
from __future__ import annotations

import math

import numpy as np
import pytest

from resihp.coordinator.model.costmodel import (
    Calibrator,
    ChunkFlops,
    LinearCost,
    embedding_flops,
    features,
    fit_linear_cost,
    head_flops,
    layer_flops,
    matmul_params_per_layer,
    stage_flops,
)
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset

# h=8, 2 heads of dim 4, 1 kv head (GQA), SwiGLU ffn 16
SMALL = ModelSpec("small", num_layers=2, hidden=8, num_heads=2, ffn_hidden=16, vocab=10, num_kv_heads=1, gated_mlp=True)


def test_features_are_tokens_and_sum_of_squares() -> None:
    assert features([3, 1]) == (4.0, 10.0)
    assert features([]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        features([3, -1])
    with pytest.raises(ValueError, match="finite and >= 0"):
        features([float("nan")])  # type: ignore[list-item]  # not an int on purpose: the check under test


def test_layer_flops_hand_computed_gqa_swiglu() -> None:
    # P = h(h + 2·g·d) + h² + 3·h·f = 8·(8+8) + 64 + 384 = 576
    assert matmul_params_per_layer(SMALL) == 576
    # tokens 4, Σl² = 9 + 1 = 10: L = 2·4·576 = 4608, A = 2·h·Σl² = 160
    got = layer_flops(SMALL, [3, 1])
    assert got == ChunkFlops(f=4608 + 160, b=4608 + 320, w=4608)
    assert got.total == 3 * 4608 + 3 * 160
    half = layer_flops(SMALL, [3, 1], tp=2)
    assert half == got.scale(0.5)


def test_plain_mlp_and_mha_counts_two_ffn_matrices() -> None:
    spec = ModelSpec("mha", 1, 8, 2, 16, 10)  # kv heads = heads, GELU MLP
    assert matmul_params_per_layer(spec) == 8 * 24 + 64 + 2 * 8 * 16
    assert layer_flops(spec, [5]).w == 2 * 5 * matmul_params_per_layer(spec)


def test_six_params_tokens_rule_for_long_batches() -> None:
    spec = preset("llama2-7b")
    seqlens = [512] * 16  # 8K tokens of short documents: the attention share is small
    tokens = 8192
    per_layer = layer_flops(spec, seqlens).total
    rule = 6 * spec.params_per_layer() * tokens
    assert per_layer == pytest.approx(rule, rel=0.02)
    assert per_layer > rule  # the attention term only adds
    # the whole model (embedding gathers are free, the LM head is a matmul)
    model = stage_flops(spec, seqlens, spec.num_layers, first=True, last=True).total
    assert model == pytest.approx(6 * spec.total_params() * tokens, rel=0.03)


def test_attention_term_is_quadratic_per_document() -> None:
    spec = preset("llama2-7b")
    one_long = layer_flops(spec, [8192])
    many_short = layer_flops(spec, [1024] * 8)
    # same tokens: the linear parts agree, only attention differs
    assert one_long.w == many_short.w
    att_long = one_long.f - one_long.w
    att_short = many_short.f - many_short.w
    assert att_long == pytest.approx(8 * att_short)  # Σl²: 8192² vs 8·1024²
    assert att_long == 2 * spec.hidden * 8192**2
    # B carries the attention twice
    assert one_long.b - one_long.w == pytest.approx(2 * att_long)
    # doubling a document's length quadruples its attention FLOPs
    assert (layer_flops(spec, [4096]).f - layer_flops(spec, [4096]).w) * 4 == att_long


def test_stage_head_and_embedding() -> None:
    seq = [3, 1]
    assert embedding_flops(SMALL, seq) == ChunkFlops(0.0, 0.0, 0.0)
    head = head_flops(SMALL, seq)
    assert head == ChunkFlops(2 * 4 * 8 * 10, 2 * 4 * 8 * 10, 2 * 4 * 8 * 10)
    both = stage_flops(SMALL, seq, 2, first=True, last=True)
    assert both == layer_flops(SMALL, seq).scale(2) + head


def test_bad_tp_and_layers_are_rejected() -> None:
    with pytest.raises(SpecError, match="tp must be a positive integer dividing num_heads"):
        layer_flops(SMALL, [3], tp=3)
    with pytest.raises(SpecError, match="num_layers"):
        stage_flops(SMALL, [3], -1)


# --- calibration ----------------------------------------------------------------------

ALPHA, BETA, GAMMA = 2e-6, 1e-10, 5e-3


def _synthetic(n: int, seed: int, outlier_share: float = 0.05) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Packed micro-batches of 4K-16K tokens, 1 % timing noise, GC-like outliers 1.5-3x slow."""
    rng = np.random.default_rng(seed)
    batches: list[list[int]] = []
    for _ in range(n):
        budget = int(rng.integers(4096, 16385))
        docs: list[int] = []
        while sum(docs) < budget:
            docs.append(int(min(budget - sum(docs), max(16, rng.lognormal(6.5, 1.3)))))
        batches.append(docs)
    feats = np.array([features(b) for b in batches])
    clean = ALPHA * feats[:, 0] + BETA * feats[:, 1] + GAMMA
    times = clean * (1 + 0.01 * rng.standard_normal(n))
    bad = rng.choice(n, size=int(round(outlier_share * n)), replace=False)
    times[bad] *= rng.uniform(1.5, 3.0, size=len(bad))
    return batches, feats, times


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_coefficients_despite_outliers(seed: int) -> None:
    _, feats, times = _synthetic(256, seed)
    fit = fit_linear_cost(feats[:, 0], feats[:, 1], times)
    assert fit.alpha == pytest.approx(ALPHA, rel=0.02)
    assert fit.beta == pytest.approx(BETA, rel=0.02)
    assert fit.gamma == pytest.approx(GAMMA, rel=0.02)
    # plain least squares is dragged by the same outliers
    x = np.column_stack([feats[:, 0], feats[:, 1], np.ones(len(times))])
    ols = np.linalg.lstsq(x, times, rcond=None)[0]
    assert max(abs(ols[0] / ALPHA - 1), abs(ols[2] / GAMMA - 1)) > 0.02


def test_fit_keeps_coefficients_non_negative() -> None:
    tokens = [1000.0, 2000.0, 3000.0, 4000.0]
    sum_sq = [1e6, 1e6, 1e6, 1e6]
    times = [0.011, 0.012, 0.013, 0.014]  # pure tokens trend
    fit = fit_linear_cost(tokens, sum_sq, times)
    assert min(fit.alpha, fit.beta, fit.gamma) >= 0
    assert fit.predict(2500.0, 1e6) == pytest.approx(0.0125, rel=1e-6)
    # a decreasing trend cannot give a negative alpha
    fit = fit_linear_cost(tokens, sum_sq, times[::-1])
    assert fit.alpha == 0.0 and fit.gamma > 0


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="equal length"):
        fit_linear_cost([1.0, 2.0], [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="times must be finite and > 0.*sample 1"):
        fit_linear_cost([1.0, 2.0], [1.0, 4.0], [1.0, math.nan])
    with pytest.raises(ValueError, match="times must be finite and > 0"):
        fit_linear_cost([1.0], [1.0], [-1.0])
    with pytest.raises(ValueError, match="no samples"):
        fit_linear_cost([], [], [])
    with pytest.raises(ValueError, match="tokens must be finite"):
        fit_linear_cost([-1.0], [1.0], [1.0])


def test_calibrator_online_per_key_and_bounded() -> None:
    batches, _, times = _synthetic(400, seed=5)
    cal = Calibrator(window=256, min_samples=8)
    assert not cal.ready(("s0", "F"))
    with pytest.raises(KeyError, match="no samples"):
        cal.model(("s0", "F"))
    for i in range(4):
        cal.add(("s0", "F"), batches[i], float(times[i]))
    with pytest.raises(ValueError, match="has 4 samples, needs 8"):
        cal.predict(("s0", "F"), [100])
    for i in range(4, 400):
        cal.add(("s0", "F"), batches[i], float(times[i]))
        cal.add(("s0", "B"), batches[i], 2 * float(times[i]))
    assert cal.samples(("s0", "F")) == 256  # window keeps the most recent
    assert cal.ready(("s0", "B")) and set(cal.keys()) == {("s0", "F"), ("s0", "B")}
    probe = [2048, 1024, 512]
    truth = LinearCost(ALPHA, BETA, GAMMA).predict_seqlens(probe)
    assert cal.predict(("s0", "F"), probe) == pytest.approx(truth, rel=0.02)
    assert cal.predict(("s0", "B"), probe) == pytest.approx(2 * truth, rel=0.02)
    assert cal.model(("s0", "F")) is cal.model(("s0", "F"))  # cached until new samples
    with pytest.raises(ValueError, match="time_s must be finite and > 0"):
        cal.add(("s0", "F"), [10], float("nan"))
    cal.reset(("s0", "B"))
    assert not cal.ready(("s0", "B"))
    with pytest.raises(ValueError, match="min_samples <= window"):
        Calibrator(window=4, min_samples=8)


def test_nnls_small_skips_subsets_only_when_the_full_fit_is_feasible() -> None:
    """``_nnls_small`` returns the unconstrained fit at once when its coefficients are all
    >= 0 (no subset can fit better); every answer must equal the exhaustive active-set search
    it replaced, feasible and infeasible cases alike."""
    import itertools

    from resihp.coordinator.model.costmodel import _nnls_small

    def exhaustive(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        xs, ys = x * np.sqrt(w)[:, None], y * np.sqrt(w)
        best, best_sse = np.zeros(x.shape[1]), float(ys @ ys)
        for size in range(x.shape[1], 0, -1):
            for cols in itertools.combinations(range(x.shape[1]), size):
                coef = np.linalg.lstsq(xs[:, cols], ys, rcond=None)[0]
                if np.any(coef < 0):
                    continue
                sse = float(np.sum((ys - xs[:, cols] @ coef) ** 2))
                if sse < best_sse * (1 - 1e-12):
                    best_sse, best = sse, np.zeros(x.shape[1])
                    best[list(cols)] = coef
        return best

    rng = np.random.default_rng(3)
    feasible = infeasible = 0
    for i in range(600):
        n = int(rng.integers(3, 40))
        tok = rng.integers(64, 8192, n).astype(float)
        ssq = tok ** 2 * (rng.uniform(0.1, 1, n) if i % 3 else 1.0)
        a, b, g = rng.uniform(-1e-6, 1e-5), rng.uniform(-1e-10, 1e-9), rng.uniform(-1e-3, 1e-2)
        y = np.abs(a * tok + b * ssq + g) * rng.lognormal(0, 0.2, n) + 1e-6
        x = np.column_stack([tok / tok.max(), ssq / ssq.max(), np.ones(n)])
        w = 1.0 / y ** 2
        want = exhaustive(x, y, w)
        np.testing.assert_array_equal(_nnls_small(x, y, w), want)
        full = np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
        feasible += bool(np.all(full >= 0))
        infeasible += bool(np.any(full < 0))
    assert feasible > 50 and infeasible > 50  # both paths were exercised
