"""The predictor's re-warming after a plan change (``Predictor`` inherits it; split out only
to keep modules small).

The detector tags the ranks whose work changed, so their keys are new, and ``start_rewarm``
marks every key of the new plan that has no calibration yet. Such a key learns from every
sample offered (not a sampled few) for ``iters`` iterations that gave it samples and is then
fitted on all of them (``tick_rewarm``); until then the detector does not judge the evidence
that depends on it (``rank_rewarm``). Meanwhile ``seed_rewarm`` prices it from the fits the
detector already has (seeds.py). Pure (numpy only), deterministic.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.evidence import IterationTimings, PlanIndex, group_all
from resihp.coordinator.detector.seeds import Key, KeyShapes, seed_compute, seed_level, seed_p2p
from resihp.coordinator.model.costmodel import Calibrator

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Rewarming:
    # the predictor's state this part reads and writes (set by Predictor.__init__ / reindex)
    index: PlanIndex
    cal: Calibrator
    A: FloatArray
    B: FloatArray
    G: FloatArray
    level: FloatArray
    samples_per_key: int
    step_key: dict[int, tuple[object, ...]]
    pricing_epoch: int
    rw_left: IntArray
    rw_idle: IntArray
    _hist: dict[Hashable, deque[float]]
    _rewarm: dict[Hashable, tuple[int, int]]
    _rw_iters: int
    _seeded: set[int]
    _cross_tp: set[int]
    _seed_kids: set[int]
    _interim: set[Hashable]
    _fitted: int
    _ready_chunks: bool
    _ckeys: IntArray
    _mkeys: IntArray
    _fit: Callable[[int], None]
    _learn: Callable[[IterationTimings, FloatArray, FloatArray, BoolArray, IntArray, int, BoolArray | None,
                      FloatArray | None, FloatArray | None], BoolArray]

    def _rescale_seed(self, kid: int, tolerance: float = 1.5, high_only: bool = False) -> bool:
        """A seeded key's first samples on the new layout: the seed scaled by the median of
        observed / seeded time when that is off by more than ``tolerance`` (one parameter
        from a few cold iterations, not three: a full fit of them read 30–45 % high), else the
        seed stands; either way it now counts as fitted for pricing. ``high_only``: act only
        on a seed above its samples (returns whether it did; the seed stays pending otherwise)."""
        r = 1.0
        samples = self.cal.samples_of(self.index.keys[kid])
        if samples:
            arr = np.asarray(samples, dtype=np.float64)
            seeded = self.A[kid] * arr[:, 0] + self.B[kid] * arr[:, 1] + self.G[kid]
            ok = seeded > 0
            if ok.any():
                r = float(np.median(arr[ok, 2] / seeded[ok]))
        if not (np.isfinite(r) and r > 0):
            r = 1.0
        if high_only and not r < 1.0 / tolerance:
            return False
        if not 1.0 / tolerance <= r <= tolerance:
            self.A[kid], self.B[kid], self.G[kid] = self.A[kid] * r, self.B[kid] * r, self.G[kid] * r
            self._fitted += 1
        self._seeded.discard(kid)
        return True

    @property
    def seeds_pending(self) -> bool:
        """Whether some key is still priced by a seed across TP sizes (the predicted iteration
        is provisional until it is checked against the key's first samples)."""
        return bool(self._seeded)

    def _calibrated(self, kid: int) -> bool:
        key = self.index.keys[kid]
        if key[0] == "dp":
            return key in self._hist
        if key[0] == "opt":
            return key in self._hist or self.cal.ready(self.step_key[kid])
        return self.cal.ready(key)

    def start_rewarm(self, iters: int) -> int:
        """Every key of the current plan with no calibration yet re-learns for ``iters``
        iterations (keys already re-warming keep their count). Returns how many keys."""
        for kid, key in enumerate(self.index.keys):
            if key not in self._rewarm and not self._calibrated(kid):
                self._rewarm[key] = (iters, 0)
                self.rw_left[kid] = iters
                self.rw_idle[kid] = 0
        self._rw_iters = iters
        self._ready_chunks = False
        return len(self._rewarm)

    def seed_rewarm(self, shapes: KeyShapes) -> int:
        """Price the re-warming keys that have no fit from the fitted keys (seeds.py) until
        their own window ends; returns how many were seeded. A seed is never judged: the
        evidence of a re-warming key is not."""
        keys = self.index.keys
        # every fitted key this detector has learned, the plans before this one's included
        fitted: dict[Key, tuple[float, float, float]] = {}
        for key in self.cal.keys():
            if isinstance(key, tuple) and key[:1] in (("compute",), ("p2p",)) and key not in self._rewarm \
                    and self.cal.ready(key):
                m = self.cal.model(key)
                fitted[key] = (m.alpha, m.beta, m.gamma)
        levels = {key: float(np.median(np.asarray(h))) for key, h in self._hist.items()
                  if isinstance(key, tuple) and key[:1] in (("dp",), ("opt",)) and key not in self._rewarm and h}
        seeded = 0
        for kid in np.nonzero(self.rw_left > 0)[0].tolist():
            key = keys[kid]
            if key[0] in ("dp", "opt"):
                if np.isnan(self.level[kid]) and (lvl := seed_level(key, levels, shapes)) is not None:
                    self.level[kid] = lvl
                    seeded += 1
                continue
            if not np.isnan(self.A[kid]):
                continue
            got = seed_compute(key, fitted, shapes) if key[0] == "compute" else (seed_p2p(key, fitted), False)
            if got is not None and got[0] is not None:
                self.A[kid], self.B[kid], self.G[kid] = got[0]
                self._seed_kids.add(kid)
                if got[1]:  # only a seed across TP sizes is provisional (seeds.py)
                    self._seeded.add(kid)
                    self._cross_tp.add(kid)
                seeded += 1
        if seeded:
            self._fitted += 1
        return seeded

    @property
    def rewarming(self) -> bool:
        return bool(self._rewarm)

    def rewarm_keys(self) -> BoolArray:
        out: BoolArray = self.rw_left > 0
        return out

    def rank_rewarm(self) -> tuple[BoolArray, BoolArray, BoolArray]:
        """Per rank: (compute keys, communication keys, step key) in their re-warm window."""
        rw = np.append(self.rw_left > 0, False)
        ck: BoolArray = np.any(rw[self._ckeys], axis=1)
        mk: BoolArray = np.any(rw[self._mkeys], axis=1)
        sk: BoolArray = rw[self.index.okey]
        return ck, mk, sk

    def rewarm_calibrate(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, alive: BoolArray,
                         slow: BoolArray, comm: BoolArray, factor: FloatArray, coupled: bool = False,
                         doubtful: BoolArray | None = None) -> None:
        """One learning iteration of the re-warming keys: every sample of the TP groups
        that use one (enough per key to fill the calibration window within the re-warm),
        then ``tick_rewarm``. Live healthy ranks teach; a confirmed-slow rank (``slow``,
        link-slow where ``comm``, by ``factor``) only where its TP group has no healthy
        member (a median of two would mix it in), with its times divided by its factor:
        what a healthy device would take in its place. ``coupled``: the compute spans are
        wall spans that contain TP collectives (the trace has ``TP`` chunks), so a member of
        a group with a slow member runs as slow as it and does not teach either.
        ``doubtful``: ranks whose slow verdict lapsed while they sat idle, with no evidence
        since that they recovered (idle.py). They may still be slow, and they carry no factor
        to divide by: they teach a key only where no other group teaches it this iteration.
        (A 2x rank taken back into a TP2 group taught the median of the two, 1.5x, and was
        then reported as a degraded DP ring, never as the compute slowdown it was.)"""
        ix = self.index
        ck, mk, sk = self.rank_rewarm()
        groups = np.unique(ix.group_of[ck | mk | sk])
        if not len(groups):
            return
        doubt = np.zeros_like(slow) if doubtful is None else doubtful & alive & ~slow
        healthy = alive & ~slow & ~doubt
        if coupled:
            healthy = healthy & group_all(~(slow | doubt), ix)
        alone = (np.bincount(ix.group_of, weights=healthy, minlength=ix.n_groups) == 0)[ix.group_of]
        learn = healthy | (alive & slow & alone)
        f = np.maximum(factor, 1.0)
        div_c = np.where(slow & ~comm, f, 1.0)
        div_m = np.where(slow & comm, f, 1.0)
        per_key = max(self.samples_per_key, -(-self.cal.window // max(1, int(self.rw_left.max()))))
        only = self.rw_left > 0
        got = self._learn(t, tok, ssq, learn, groups, per_key, only, div_c, div_m)
        fallback = doubt & alone
        if fallback.any():  # the doubtful ranks' own times, for keys nobody else taught
            got |= self._learn(t, tok, ssq, learn | fallback, np.unique(ix.group_of[fallback]), per_key,
                               only & ~got, div_c, div_m)
        self.tick_rewarm(got)

    def tick_rewarm(self, got: BoolArray) -> None:
        """Count one learning iteration for the re-warming keys: one that got samples is
        fitted on all of them after its count (or stays while it has too few to fit); one
        that got none for as many iterations in a row leaves the window unfitted (no
        evidence of this job uses it: say P2P keys of a trace without P2P timings)."""
        rw = self.rw_left > 0
        if not rw.any():
            return
        hit = rw & got
        self.rw_idle = np.where(hit, 0, np.where(rw, self.rw_idle + 1, self.rw_idle))
        self.rw_left = np.where(hit, self.rw_left - 1, self.rw_left)
        idle = rw & (self.rw_idle >= self._rw_iters)
        keys = self.index.keys
        # a key still in its window prices with its own first fit as soon as it has enough
        # samples (once): the seed gives way within a few iterations, the judging still waits
        for kid in np.nonzero(hit & (self.rw_left > 0))[0].tolist():
            key = keys[kid]
            learned = self._rw_iters - self.rw_left[kid]
            # a seed across TP sizes above its very first samples is too high for sure (cold
            # iterations only ever read slow): rescaled at once. From TP2 to TP1 on CPU a
            # FLOPs-scaled seed read 2.7x the time for the three cold iterations it stood
            if kid in self._cross_tp and learned < 3 and self._rescale_seed(kid, high_only=True):
                self._cross_tp.discard(kid)
                self._interim.add(key)
                self.pricing_epoch += 1
                continue
            # three learning iterations first: the first ones after a switch run cold
            if key in self._interim or not self._calibrated(kid) or learned < 3:
                continue
            self._interim.add(key)
            if key[0] in ("dp", "opt"):
                hist = self._hist.get(key)
                if hist and len(hist) >= 3 and float(np.median(np.asarray(hist))) > 0:
                    self.level[kid] = float(np.median(np.asarray(hist)))
                    self._seeded.discard(kid)
            elif kid in self._cross_tp:
                # a seed scaled across TP sizes is checked against the first samples
                self._cross_tp.discard(kid)
                self._rescale_seed(kid)
                self.pricing_epoch += 1
            elif kid in self._seed_kids:
                # one of its own TP size, or a P2P hop's (the same hop's fit), stands until the
                # window's fit: the first samples run cold. After a fail-stop a fit of them
                # priced the new layer split 2x high for 5 iterations (bench/e2e.py), the seed
                # within 17 % of the window's fit
                continue
            else:
                self._fit(kid)
        ended = hit & (self.rw_left <= 0)
        if ended.any():
            self.pricing_epoch += 1
        for kid in np.nonzero(ended)[0].tolist():
            if not self._calibrated(kid):
                self.rw_left[kid] = 1  # too few samples to fit yet: stay in the window
            elif keys[kid][0] in ("dp", "opt"):
                hist = self._hist.get(keys[kid])
                if hist:
                    self.level[kid] = float(np.median(np.asarray(hist)))
                    self._seeded.discard(kid)
            else:
                self._fit(kid)  # on every sample of the window, not the first min_samples
        self.rw_left[idle] = 0
        for kid in np.nonzero(rw)[0].tolist():
            if self.rw_left[kid] > 0:
                self._rewarm[keys[kid]] = (int(self.rw_left[kid]), int(self.rw_idle[kid]))
            else:
                self._rewarm.pop(keys[kid], None)
        self._ready_chunks = False
