"""Seeds for the cost keys a re-plan creates, from the keys already fitted, and the share of
an iteration the schedule does not explain.

After a reconfiguration the stages whose work changed get new cost keys (a layer range on a
TP size, a DP ring of another shard). They re-learn from the new layout's first iterations
(predictor.start_rewarm), and until they are fitted the predicted iteration left them out:
right after a re-plan it read 4.5× low (bench/e2e.py's ``post_replan_itp_error_3``). A new
key is seeded instead from the fitted keys of the same kind, scaled by the cost model:

- compute (F / B / W of layers [lo, hi) on TP k): α by the per-token matmul FLOPs, β by the
  per-Σl² attention FLOPs, γ (per-op overhead) by the layer count; the median over the
  fitted keys of the same chunk kind and TP size (of any TP size when there is none: such a
  seed is checked against the key's first three iterations of samples and scaled by their
  median ratio when it is off by more than 1.5×, since a narrow TP shard's per-op overhead
  does not scale with its FLOPs);
- P2P hop: the median of the fitted hops of the same direction and node crossing (a
  boundary activation has the same size at every boundary);
- DP ring: the fitted rings' levels by the shard's parameters × the ring's 2(d − 1)/d;
- optimizer step: by the shard's parameters.

The seed only prices; it is never judged (a re-warming key's evidence is not judged) and the
key's own fit replaces it once its window ends.

``PauseShare``: what the compiled schedule leaves out of an iteration (Python between ops,
the hooks, a shared machine's scheduling) as a share of the simulated time, the median of
recent healthy iterations; a plan change keeps the last level as the first sample of the
next plan's window. Pure (numpy only), deterministic.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from resihp.coordinator.model.spec import ModelSpec

Key = tuple[object, ...]


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise TypeError(f"expected an integer in a cost key, got {value!r}")
    return value


def _spans(ranges: object) -> list[tuple[int, int]]:
    """The (lo, hi) layer ranges of a DP / optimizer key."""
    if not isinstance(ranges, tuple):
        raise TypeError(f"expected layer ranges in a cost key, got {ranges!r}")
    return [(_int(r[0]), _int(r[1])) for r in ranges]


class KeyShapes:
    """What a key's cost scales with, from the model (``ModelSpec``)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def compute(self, key: Key) -> tuple[float, float, float] | None:
        """(matmul FLOPs per token, attention FLOPs per Σl², layers) of a compute key."""
        try:
            _, kind, lo, hi, where, tp = key[:6]
            layers, k = _int(hi) - _int(lo), _int(tp)
        except (ValueError, TypeError):
            return None
        s = self.spec
        linear = 2.0 * layers * s.params_per_layer() / k
        if "last" in str(where):
            linear += 2.0 * s.hidden * s.vocab / k
        attn = 2.0 * s.hidden * layers / k * (2.0 if kind == "B" else 0.0 if kind == "W" else 1.0)
        return linear, attn, float(max(layers, 1))

    def shard_params(self, key: Key) -> float | None:
        """Parameters of a DP / optimizer key's shard."""
        try:
            spans, tp = _spans(key[1]), _int(key[2])
        except (ValueError, TypeError, IndexError):
            return None
        s = self.spec
        layers = sum(hi - lo for lo, hi in spans)
        ends = any(lo == 0 for lo, _ in spans) + any(hi == s.num_layers for _, hi in spans)
        return (layers * s.params_per_layer() + ends * s.embedding_params()) / tp

    @staticmethod
    def ring_share(key: Key) -> float:
        d = _int(key[3]) if len(key) > 3 else 1
        return 2.0 * (d - 1) / d if d > 1 else 0.0


def _med(values: Sequence[float]) -> float | None:
    vals = [v for v in values if math.isfinite(v)]
    return statistics.median(vals) if vals else None


def seed_compute(key: Key, fitted: dict[Key, tuple[float, float, float]],
                 shapes: KeyShapes) -> tuple[tuple[float, float, float], bool] | None:
    """((α, β, γ), whether it crossed TP sizes) for a new compute key from the fitted ones of
    its chunk kind: those of its own TP size when there are any (FLOPs scale well across layer
    counts; across TP sizes a narrow shard's per-op overhead does not scale with its FLOPs)."""
    want = shapes.compute(key)
    if want is None:
        return None
    kind = {ref: c for ref, c in fitted.items() if ref[0] == "compute" and ref[1] == key[1]}
    same_tp = {ref: c for ref, c in kind.items() if ref[5] == key[5]}
    a, b, g = [], [], []
    for ref, (ra, rb, rg) in (same_tp or kind).items():
        have = shapes.compute(ref)
        if have is None or have[0] <= 0:
            continue
        a.append(ra * want[0] / have[0])
        b.append(rb * want[1] / have[1] if have[1] > 0 else rb)
        g.append(rg * want[2] / have[2])
    ma, mb, mg = _med(a), _med(b), _med(g)
    return None if ma is None or mb is None or mg is None else ((ma, mb, mg), not same_tp)


def seed_p2p(key: Key, fitted: dict[Key, tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(α, β, γ) for a new P2P hop: the fitted hops of its direction and node crossing (its TP
    size first)."""
    same = [c for ref, c in fitted.items() if ref[0] == "p2p" and ref[1] == key[1] and ref[4] == key[4]]
    exact = [c for ref, c in fitted.items() if ref[0] == "p2p" and ref[1:2] + ref[3:5] == key[1:2] + key[3:5]]
    pool = exact or same
    if not pool:
        return None
    cols = [_med([c[i] for c in pool]) for i in range(3)]
    return None if any(v is None for v in cols) else (cols[0], cols[1], cols[2])  # type: ignore[return-value]


def seed_level(key: Key, levels: dict[Key, float], shapes: KeyShapes) -> float | None:
    """A DP ring's or optimizer step's seconds from the fitted levels of its kind."""
    want = shapes.shard_params(key)
    if want is None or (key[0] == "dp" and shapes.ring_share(key) <= 0):
        return None  # a replica alone has no ring to price
    out = []
    for ref, level in levels.items():
        if ref[0] != key[0] or not (math.isfinite(level) and level > 0):
            continue
        have = shapes.shard_params(ref)
        if not have:
            continue
        scale = want / have
        if key[0] == "dp":
            share = shapes.ring_share(ref)
            if share <= 0:
                continue
            scale *= shapes.ring_share(key) / share
        out.append(level * scale)
    return _med(out)


class PauseShare:
    """What the schedule leaves out of recent healthy iterations: ``mode`` "share" learns
    observed / simulated − 1 (clipped to [−0.5, 10]) and predicts simulated × (1 + median);
    "gap" learns observed − simulated seconds and adds the median."""

    def __init__(self, window: int = 32, mode: str = "gap", gate: float = 0.15) -> None:
        if mode not in ("share", "gap"):
            raise ValueError(f"PauseShare: mode must be 'share' or 'gap', got {mode!r}")
        self.mode = mode
        self.gate = gate
        self._vals: deque[float] = deque(maxlen=window)

    def level(self) -> float:
        return statistics.median(self._vals) if self._vals else 0.0

    def predict(self, simulated_s: float) -> float:
        level = self.level()
        # a gap learnt against another plan's schedule never takes more than half of this one
        return simulated_s * (1.0 + level) if self.mode == "share" else max(simulated_s + level, 0.5 * simulated_s)

    def learn(self, observed_s: float, simulated_s: float) -> None:
        """One healthy iteration's sample. Once the window holds a few, an iteration more than
        ``gate`` above the current prediction is not taken: a device that is slow before the
        detector has confirmed it would otherwise become part of the "healthy" time."""
        if simulated_s > 0 and math.isfinite(observed_s) and math.isfinite(simulated_s) and observed_s > 0:
            if len(self._vals) >= 4 and observed_s > self.predict(simulated_s) * (1.0 + self.gate):
                return
            if self.mode == "share":
                self._vals.append(min(max(observed_s / simulated_s - 1.0, -0.5), 10.0))
            else:
                self._vals.append(max(observed_s - simulated_s, -0.5 * simulated_s))

    def reseed(self) -> None:
        """A new plan: its window starts from the last plan's level (one sample)."""
        level = self.level()
        self._vals.clear()
        if level:
            self._vals.append(level)


__all__ = ["KeyShapes", "PauseShare", "seed_compute", "seed_level", "seed_p2p"]
