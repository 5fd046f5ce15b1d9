"""The baselines resihp's detector is measured against, both on the raw iteration time.

* ``ThresholdBaseline``: an iteration that takes more than ``1 + threshold`` times the
  median of the recent normal iterations is a fail-slow (the classic straggler rule).
* ``BocdBaseline``: Greyhound-style (ATC'25) Bayesian online change-point detection
  (Adams & MacKay 2007) on the log iteration time with a Normal-Gamma model and a constant
  hazard; when the most probable run length collapses (a change point) and the new
  segment runs slower than the old one by more than ``min_shift``, that is a fail-slow.

Neither knows what the batch cost: that is the point of comparing them with resihp on the
same packed-sequence workloads. Both answer ``observe(iteration, time_s) -> bool`` (True: a
new fail-slow alarm) and re-arm once the time is back to normal. Pure numpy, deterministic.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class ThresholdBaseline:
    def __init__(self, threshold: float = 0.10, window: int = 20, warmup: int = 8, rearm: int = 3) -> None:
        if threshold <= 0 or window < 3 or warmup < 1:
            raise ValueError("ThresholdBaseline: threshold must be > 0, window >= 3, warmup >= 1")
        self.threshold = threshold
        self.warmup = warmup
        self.rearm = rearm
        self._recent: deque[float] = deque(maxlen=window)
        self._alarmed = False
        self._normal_run = 0

    def observe(self, iteration: int, time_s: float) -> bool:
        if len(self._recent) < self.warmup:
            self._recent.append(time_s)
            return False
        ref = float(np.median(np.asarray(self._recent)))
        slow = time_s > (1.0 + self.threshold) * ref
        if not slow:
            self._recent.append(time_s)
            self._normal_run += 1
            if self._alarmed and self._normal_run >= self.rearm:
                self._alarmed = False
            return False
        self._normal_run = 0
        if self._alarmed:
            return False
        self._alarmed = True
        return True


class BocdBaseline:
    """Adams & MacKay's run-length filter, truncated at ``max_run`` for bounded cost."""

    def __init__(self, hazard: float = 1 / 100, min_shift: float = 0.03, max_run: int = 300,
                 kappa0: float = 1.0, alpha0: float = 1.0, beta_scale: float = 1e-4, warmup: int = 8) -> None:
        if not 0 < hazard < 1:
            raise ValueError(f"BocdBaseline: hazard must be in (0, 1), got {hazard}")
        self.hazard = hazard
        self.min_shift = min_shift
        self.max_run = max_run
        self.kappa0, self.alpha0, self.beta_scale = kappa0, alpha0, beta_scale
        self.warmup = warmup
        self._first: list[float] = []
        self._alarmed = False
        self._in_change = False
        self.short_run = 5
        self._hist: list[float] = []

    def _reset(self, mu0: float) -> None:
        self.log_r = np.array([0.0])  # log P(run length = r)
        self.mu = np.array([mu0])
        self.kappa = np.array([self.kappa0])
        self.alpha = np.array([self.alpha0])
        self.beta = np.array([self.beta_scale])

    def observe(self, iteration: int, time_s: float) -> bool:
        x = math.log(max(time_s, 1e-12))
        if len(self._first) < self.warmup:
            self._first.append(x)
            if len(self._first) == self.warmup:
                self._reset(float(np.mean(self._first)))
                for y in self._first:
                    self._update(y)
                self._hist.extend(self._first)
            return False
        self._update(x)
        self._hist.append(x)
        # a change point: most of the posterior mass now sits on short run lengths
        p_short = float(np.exp(self.log_r[: self.short_run + 1]).sum())
        run_map = int(np.argmax(self.log_r))
        if p_short < 0.5:
            self._in_change = False
            return False
        if self._in_change:
            return False
        self._in_change = True
        # compare the new segment's mean with the stretch before the change point
        cut = max(run_map, 1)
        new_mean = float(np.mean(self._hist[-cut:]))
        before = self._hist[-cut - 30:-cut]
        old_mean = float(np.mean(before)) if before else new_mean
        shift = math.exp(new_mean - old_mean) - 1.0
        if shift > self.min_shift and not self._alarmed:
            self._alarmed = True
            return True
        if shift < self.min_shift / 2:
            self._alarmed = False
        return False

    def _update(self, x: float) -> None:
        # predictive probability of x under each run length (Student-t)
        a, b, k, mu = self.alpha, self.beta, self.kappa, self.mu
        scale2 = b * (k + 1.0) / (a * k)
        nu = 2.0 * a
        z = (x - mu) ** 2 / (nu * scale2)
        lg = np.array([math.lgamma(v) for v in (a + 0.5).tolist()]) - np.array([math.lgamma(v) for v in a.tolist()])
        log_pred = lg - 0.5 * np.log(nu * math.pi * scale2) - (a + 0.5) * np.log1p(z)
        growth = self.log_r + log_pred + math.log(1.0 - self.hazard)
        cp = float(np.logaddexp.reduce(self.log_r + log_pred + math.log(self.hazard)))
        log_r = np.concatenate([[cp], growth])
        log_r -= float(np.logaddexp.reduce(log_r))
        # posterior parameters (run length 0 starts from the prior)
        mu_new = (k * mu + x) / (k + 1.0)
        beta_new = b + k * (x - mu) ** 2 / (2.0 * (k + 1.0))
        self.mu = np.concatenate([[self._prior_mu()], mu_new])
        self.kappa = np.concatenate([[self.kappa0], k + 1.0])
        self.alpha = np.concatenate([[self.alpha0], a + 0.5])
        self.beta = np.concatenate([[self.beta_scale], beta_new])
        self.log_r = log_r
        if len(self.log_r) > self.max_run:
            keep = self.max_run
            for name in ("log_r", "mu", "kappa", "alpha", "beta"):
                setattr(self, name, getattr(self, name)[:keep])
            self.log_r -= float(np.logaddexp.reduce(self.log_r))

    def _prior_mu(self) -> float:
        return float(np.mean(self._first))
