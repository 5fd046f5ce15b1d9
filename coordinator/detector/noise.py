"""Noise-adaptive judging of a rank's ratios: each evidence key learns its own healthy spread.

A fixed threshold (compute 5 % above the model) is wrong in both directions: on a shared CPU
or a busy fabric one key's ratio swings by ±30 % from one iteration to the next, on a quiet
GPU by ±1 %. Here every key — a rank's compute ratio, its link / DP-ring ratio — keeps a
sliding window of the ratios it showed while healthy, and judges a new ratio in units of
that window's robust spread:

- baseline ``m``: the window's median; spread ``s``: 1.4826 × its MAD (the standard
  deviation of Gaussian noise), never below ``min_spread`` × m;
- each iteration's deviation ``z = (x - m) / s`` is clipped at ±``clip``: one GC pause or
  data-loader stall moves the test by at most ``clip`` (below the alarm level), however long;
  the healthy window's own mean clipped deviation is taken off (skewed noise — stalls are
  only ever late — has a mean above its median);
- the test is a multi-scale mean shift (a generalised likelihood ratio over the change point):
  ``G = max over w in 1, 2, 4 … 64 of Σ(last w z) / (s2 · √w)``, where ``s2`` is the spread of
  the clipped deviations of the healthy window itself (heavy-tailed noise makes it > 1). A
  slowdown beyond ``level`` spreads (× s2) in three consecutive iterations crosses at once
  (``min`` of the three unclipped deviations: no stall can fake it), a small one (1.1× under 3 % noise) in a
  few, a 1.3× slowdown under 30 % noise in some tens, and stationary noise — however wide —
  seldom: at level 5 a Gaussian key crosses about once in 10⁶ iterations per scale;
- it is a suspect only if the mean relative excess (x − m) / m of the window that crossed,
  unclipped, is also above ``floor``: a tiny but very stable shift is not worth a re-plan.

Until a key has ``min_samples`` healthy ratios its baseline is the calibrated cost model's
(ratio 1) and its spread ``prior_spread``, or — after a plan change moved the rank — the
spread it had before (its noise is the device's and host's, not the layout's). The baselines
are refreshed every ``REFRESH`` iterations, a thirty-second of the ranks at a time (a median over
the window is the expensive part: at 4096 ranks the whole set at once took 20 ms). The ring
buffers keep the iteration axis first, so that one iteration's slot is contiguous.
Pure (numpy only).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

SCALES = (1, 2, 4, 8, 16, 32, 64)
W = np.asarray(SCALES, dtype=np.float64)
# three consecutive iterations each beyond this share of the level (and each above the effect
# floor) cross it at once: for Gaussian noise a chance of ~(1.6e-4)³ per key and iteration at
# level 6, while a slowdown of 3.6 spreads is found in three iterations
JUMP_SHARE = 0.6
# kinds (columns) whose jump must also clear the largest ratio of the key's healthy window: the
# transfers (column 1). Per-transfer jitter is heavy-tailed (lognormal, congestion spikes), which
# a MAD spread does not see: under 30 % jitter one DP ring's healthy ratios reached 3.5x its
# baseline and three in a row above 1.8x were reported as a slow ring. Compute (column 0)
# keeps the rule as it was: a stall hits one iteration, and the jump there is what finds a
# throttle within three
TAIL_KINDS = slice(1, None)
MEDIAN_VAR = (np.pi / 2)  # variance of a sample median over the mean's, for Gaussian noise (1.2533²)
MAD_TO_SIGMA = 1.4826
REFRESH = 32  # iterations between baseline refreshes once a key is warm (a window of 64 moves little in 32)
RECENT = 8  # iterations the recovery test averages over
QUARANTINE = 64  # iterations a ratio waits before it may teach (the longest scale of the test)
# a key whose healthy median ratio is below this has no scale to be judged in (``void``): on
# CPU / loopback most P2P waits of some ranks find their data already there and read 0, and a
# baseline of 0 made every later transfer an infinite excess (and the key's sums NaN for good)
MIN_BASE = 0.05


class NoiseModel:
    """Healthy baselines and the multi-scale shift test for ``n`` ranks × ``kinds`` evidence."""

    def __init__(self, ranks: Sequence[int], kinds: int = 2, *, window: int = 64, level: float = 6.0,
                 clip: float = 3.0, floor: float = 0.05, prior_spread: float = 0.10, min_spread: float = 0.01,
                 min_samples: int = 8) -> None:
        self.ranks = tuple(ranks)
        self.kinds = kinds
        self.window, self.level, self.clip, self.floor = window, level, clip, floor
        self.prior_spread, self.min_spread, self.min_samples = prior_spread, min_spread, min_samples
        self._alloc(len(self.ranks))
        self._prior = np.full((len(self.ranks), kinds), prior_spread)
        self._measured = np.zeros((len(self.ranks), kinds), dtype=bool)  # the prior is a spread it had
        self._turn = 0

    def _alloc(self, n: int) -> None:
        k, zw = self.kinds, SCALES[-1]
        self.hist = np.full((n, k, self.window), np.nan)  # healthy ratios (ring)
        self.hpos = np.zeros((n, k), dtype=np.int64)
        self.hcount = np.zeros((n, k), dtype=np.int64)
        self.m = np.ones((n, k))
        self.s = np.full((n, k), self.prior_spread)
        self.s2 = np.ones((n, k))
        self.zprev = np.zeros((n, k))  # the previous iteration's unclipped deviation
        self.zprev2 = np.zeros((n, k))  # ... and the one before
        self.e = np.zeros((zw, n, k))  # recent relative excesses (ring, like z)
        self.esums = np.zeros((len(SCALES), n, k))
        self.eprev = np.zeros((n, k))
        self.eprev2 = np.zeros((n, k))
        self.mu = np.zeros((n, k))  # mean clipped deviation of the healthy window (skewed noise: not 0)
        # the healthy window's largest ratio, relative to the baseline (refreshed with it): a jump
        # of a transfer key must clear it (TAIL_KINDS)
        self.top = np.full((n, k), np.inf)
        self.void = np.zeros((n, k), dtype=bool)  # baseline below MIN_BASE: not judged (see there)
        self.z = np.zeros((zw, n, k))  # recent clipped deviations (ring, one slot per iteration)
        self.sums = np.zeros((len(SCALES), n, k))  # Σ of the last w z, per scale
        self.zpos = 0
        # iterations with evidence tested since a rank's windows were last emptied (a plan change
        # moved it, or it recovered): its recent mean deviation speaks only once RECENT are in
        self.since = np.zeros(n, dtype=np.int64)
        self._fresh = np.zeros((n, k), dtype=bool)  # got healthy samples since the last refresh
        self.far = np.zeros((n, k), dtype=bool)  # the latest iteration alone beyond the level
        # ratios wait QUARANTINE iterations before they teach the baseline, and are dropped if the
        # key is found slow meanwhile: a slowdown's onset must not become its own baseline
        self.pending = np.full((QUARANTINE, n, k), np.nan)
        self._inv_scale: FloatArray | None = None  # 1 / (s2 · the scales' units), cached
        self._tolerance: FloatArray | None = None  # recent_tolerance(), cached
        self._known_keys: BoolArray | None = None  # _known(), cached: it changes as keys reach min_samples
        self._warmed = False  # every key past 2 * min_samples samples: none refreshes on every other one
        self.recent_excess = np.zeros((n, k))  # mean relative excess of the last RECENT iterations
        self.crossed = np.full((n, k), -1, dtype=np.int64)  # the scale whose window crossed (test)
        self._phase = (np.arange(n) % REFRESH)[:, None]  # which refresh turn a rank's keys take

    # --- judging ------------------------------------------------------------------------------
    def test(self, x: FloatArray, spread_now: FloatArray | None = None) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Push this iteration's ratios ``x`` (n, kinds; NaN = no evidence, counted as no
        deviation) and return (G, relative excess of the crossing window — 0 where G is not
        above the level —, recent mean z). ``spread_now`` (n, kinds; relative, NaN = none):
        how noisy each key is in this very iteration, as its peers show (a loaded host); a
        key's deviation is taken in units of the larger of that and its own spread."""
        s = self.s if spread_now is None else np.fmax(self.s, spread_now * self.m)
        missing = ~np.isfinite(x) | self.void
        d = x - self.m
        raw = d / s
        raw -= self.mu
        raw[missing] = 0.0
        z = np.clip(raw, -self.clip - self.mu, self.clip - self.mu)
        # the relative excess itself, unclipped (the effect floor is judged on it: clipped
        # deviations of a very stable key could never show a 5 % excess)
        rel = np.clip(d / self.m, -1.0, 10.0)
        rel[missing] = 0.0
        # persistence: three consecutive iterations all far out (unclipped) — a large slowdown
        # found in three iterations, which no stall (nor two in a row) can fake
        both = np.minimum(np.minimum(raw, self.zprev), self.zprev2) / (self.s2 * JUMP_SHARE)
        both_rel = np.minimum(np.minimum(rel, self.eprev), self.eprev2)
        # a transfer key's three must each exceed its healthy window's largest ratio too
        both[:, TAIL_KINDS] = np.where(both_rel[:, TAIL_KINDS] > self.top[:, TAIL_KINDS], both[:, TAIL_KINDS], -np.inf)
        # this iteration alone far out (not yet a finding): the rank leans slow, and what the
        # job measures meanwhile (its device and link profile) should not learn from it
        self.far = np.asarray((raw / self.s2 > self.level) & (rel > self.floor) & self._known(), dtype=np.bool_)
        self.zprev2, self.zprev = self.zprev, raw
        self.eprev2, self.eprev = self.eprev, rel
        zw = self.z.shape[0]
        # the slot each scale's window lets go of; one scale at a time in place: a (scales,
        # n, kinds) temporary per update cost several times more than the arithmetic
        for j, slot in enumerate((self.zpos - np.asarray(SCALES)) % zw):
            self.sums[j] += z - self.z[slot]
            self.esums[j] += rel - self.e[slot]
        self.z[self.zpos] = z
        self.e[self.zpos] = rel
        # only an iteration with evidence counts: one whose keys were held (a re-warm after a
        # plan change) put zeros in the windows, and RECENT of those read as "back to normal"
        self.since += ~missing.all(axis=1)
        self.zpos = (self.zpos + 1) % zw
        # a window's mean is judged against a baseline that is itself a median of the healthy
        # window's n samples, uncertain by ~1.25/√n spreads: a long window's mean is as
        # precise as the baseline it is held against, so its statistic is divided by
        # √(1 + 1.57·w/n) too (at w = n = 64 this alone would otherwise read 6 spreads about
        # once per key in some hundreds of iterations of healthy noise)
        if self._inv_scale is None:  # changes only when a baseline grows (_refresh updates its keys)
            self._inv_scale = _inv_scale(self.s2, self._n_base())
        g_all = self.sums * self._inv_scale
        g = g_all.max(axis=0)
        jump = both > g
        g = np.where(jump, both, g)
        # the excess of the window that crossed, only where one did (few keys: the argmax over
        # the scales of every key is most of this function's time at 4096 ranks)
        excess = np.zeros_like(g)
        # which scale crossed (an index into SCALES; -1 none): another estimator of the same
        # quantity can be asked what it saw over that window (window_excess); a jump: 4
        self.crossed = np.where(jump, SCALES.index(4), -1)
        r, k = np.nonzero((g > self.level) & ~jump)
        if len(r):
            best = g_all[:, r, k].argmax(axis=0)
            excess[r, k] = self.esums[best, r, k] / np.asarray(SCALES, dtype=np.float64)[best]
            self.crossed[r, k] = best
        excess = np.where(jump, both_rel, excess)
        recent = self.sums[SCALES.index(RECENT)] / RECENT
        self.recent_excess = self.esums[SCALES.index(RECENT)] / RECENT  # relative, for recovery
        return g, excess, recent

    def suspect(self, g: FloatArray, excess: FloatArray) -> BoolArray:
        """Keys whose shift crossed the level with an excess above the floor. A key still in its
        first ``min_samples`` healthy iterations, with no spread measured before, is not judged:
        a job's first iterations (allocator, first touch, thread pools) teach, they do not accuse."""
        return np.asarray((g > self.level) & (excess > self.floor) & self._known(), dtype=np.bool_)

    def window_excess(self, scale: npt.NDArray[np.int64], key: int) -> FloatArray:
        """(n,) key ``key``'s mean relative excess over the last SCALES[scale[i]] iterations of
        each row (NaN where ``scale`` is -1): what this estimator saw over the window in which
        another one crossed."""
        j = np.maximum(scale, 0)
        out = self.esums[j, np.arange(len(j)), key] / W[j]
        return np.where(scale >= 0, out, np.nan)

    def relative_spread(self) -> FloatArray:
        """(n, kinds): each key's healthy spread in the test's own units (s · s2), relative to its
        baseline: a slowdown by a share f moves a key's deviation by f / this per iteration."""
        return np.asarray(self.s * self.s2 / np.maximum(np.abs(self.m), MIN_BASE), dtype=np.float64)

    def judged(self) -> BoolArray:
        """(n, kinds): keys past their first ``min_samples`` healthy ratios (or with a spread
        measured before a plan change): the test's verdict on them counts."""
        return self._known()

    def settled(self) -> BoolArray:
        """(n, kinds): keys whose spread rests on half a window of healthy ratios (or was
        measured before a plan change)."""
        return np.asarray(((self.hcount >= self.window // 2) | self._measured) & ~self.void, dtype=np.bool_)

    def _known(self) -> BoolArray:
        if self._known_keys is None:
            self._known_keys = np.asarray(((self.hcount >= self.min_samples) | self._measured) & ~self.void,
                                          dtype=np.bool_)
        return self._known_keys

    # --- learning -----------------------------------------------------------------------------
    def learn(self, x: FloatArray, ok: BoolArray, g: FloatArray | None = None) -> None:
        """Queue this iteration's ratios; the ratios of ``QUARANTINE`` iterations ago teach the
        windows of the keys that are ``ok`` now (not found slow). Every queued ratio teaches,
        calm or not — learning only calm ones would teach a spread narrower than the noise —
        but a key found slow drops its queue (``forget``). ``g``: this iteration's shift
        statistic, which keeps a leaning key from learning at once (below)."""
        slot = self.zpos % QUARANTINE  # test() advanced zpos: one slot per iteration
        old = self.pending[slot].copy()
        # a key still warming up (a job's first iterations) learns at once — unless, once it is
        # judged, its shift test already leans (half the level): a slowdown soon after the start
        # must not teach the baseline it is judged against. Before it is judged it always
        # learns: a key held back then would never get the samples to be judged at all
        warm_up = self.hcount < QUARANTINE // 2
        if g is not None:
            warm_up &= ((self.hcount < self.min_samples) & ~self._measured) | (g < 0.5 * self.level)
        self.pending[slot] = np.where(warm_up, np.nan, x)
        x = np.where(warm_up, x, old)
        take = ok & np.isfinite(x)
        self._turn = (self._turn + 1) % REFRESH
        if take.any():  # on flat views: one index array instead of three
            flat = np.flatnonzero(take)
            pos = self.hpos.reshape(-1)[flat]
            self.hist.reshape(-1, self.window)[flat, pos] = x.reshape(-1)[flat]
            self.hpos.reshape(-1)[flat] = (pos + 1) % self.window
            self.hcount.reshape(-1)[flat] += 1
            if (self.hcount.reshape(-1)[flat] == self.min_samples).any():  # a key is judged from now on
                self._known_keys = None
            self._fresh |= take
            if (self.hcount.reshape(-1)[flat] <= self.window).any():  # a baseline grew
                self._inv_scale = None
                self._tolerance = None
        # a warming key refreshes on every other sample (its baseline is still moving); the
        # others once in REFRESH iterations, each rank on its own turn
        rows = self._fresh & (self._phase == self._turn)
        if not self._warmed:  # (counts only grow: once every key is past, none warms until a remap)
            rows |= take & (self.hcount <= 2 * self.min_samples) & (self.hcount % 2 == 0)
            self._warmed = bool(self.hcount.min(initial=2 * self.min_samples + 1) > 2 * self.min_samples)
        if rows.any():
            self._refresh(rows)

    def clear_windows(self, rows: BoolArray) -> None:
        """Start the shift test afresh for ranks (``rows`` (n,)) just recovered: the slow
        period's deviations in their windows were evidence of the fault that ended, not of
        a new one."""
        self.z[:, rows] = 0.0
        self.e[:, rows] = 0.0
        self.sums[:, rows] = 0.0
        self.esums[:, rows] = 0.0
        for prev in (self.zprev, self.zprev2, self.eprev, self.eprev2):
            prev[rows] = 0.0
        self.since[rows] = 0

    def recent_known(self) -> BoolArray:
        """Ranks whose recent mean deviation rests on RECENT tested iterations with evidence: a
        rank whose windows were just emptied, or whose keys were held since (a re-warm), reads 0
        there, which is no evidence that it is back."""
        return np.asarray(self.since >= RECENT, dtype=np.bool_)

    def recent_tolerance(self) -> FloatArray:
        """(n, kinds): how much wider than its own noise a RECENT-iteration mean deviation
        reads for a key whose baseline is a median of few samples (1 for a well-known one)."""
        if self._tolerance is None:  # changes only while a baseline grows
            self._tolerance = np.asarray(np.sqrt(1.0 + MEDIAN_VAR * RECENT / self._n_base()), dtype=np.float64)
        return self._tolerance

    def samples(self) -> npt.NDArray[np.int64]:
        """(n, kinds): the samples each key's baseline median rests on (``_n_base``)."""
        return self._n_base()

    def _n_base(self) -> npt.NDArray[np.int64]:
        """(n, kinds): the samples each key's baseline median rests on (at least min_samples:
        before that the prior stands in)."""
        return np.maximum(np.minimum(self.hcount, self.window), self.min_samples)

    def forget(self, rows: BoolArray) -> None:
        """Drop the queued ratios of ranks (``rows`` (n,)) just found slow: their slowdown began
        some iterations before it was confirmed."""
        self.pending[:, rows] = np.nan

    def _refresh(self, rows: BoolArray) -> None:
        r, k = np.nonzero(rows & (self.hcount >= self.min_samples))
        self._fresh &= ~rows  # (after reading rows: it may be this very array)
        if len(r) == 0:
            return
        full = self.hcount[r, k] >= self.window
        for part, complete in ((full, True), (~full, False)):  # complete windows need no NaN handling
            if not part.any():
                continue
            pr, pk = r[part], k[part]
            # a window fills from slot 0: while few are filled, sort only those columns
            filled = int(min(self.window, int(self.hcount[pr, pk].max())))
            h = self.hist[pr, pk, :filled]  # (q, filled)
            mean = _mean_rows if complete else _nanmean_rows
            m = median_rows(h, complete)
            mad = median_rows(np.abs(h - m[:, None]), complete)
            # a spread from few samples is uncertain: widen it (×1.41 at 8 samples, ×1.06 at 64)
            few = np.sqrt(1.0 + self.min_samples / np.maximum(self.hcount[pr, pk], 1))
            void = np.abs(m) < MIN_BASE
            sp = np.where(void, self.prior_spread, np.maximum(MAD_TO_SIGMA * mad * few, self.min_spread * np.abs(m)))
            if (void != self.void[pr, pk]).any():
                self._known_keys = None
            self.void[pr, pk] = void
            zc = np.clip((h - m[:, None]) / sp[:, None], -self.clip, self.clip)
            with np.errstate(invalid="ignore"):
                mu = mean(zc)
                s2 = np.sqrt(mean((zc - mu[:, None]) ** 2))
            self.m[pr, pk] = np.where(void, 1.0, m)  # (a void key is not judged: 1 keeps its divisions finite)
            self.s[pr, pk] = sp
            with np.errstate(invalid="ignore"):
                top = h.max(axis=1) if complete else np.nanmax(h, axis=1)
            self.top[pr, pk] = (top - m) / np.where(m != 0, np.abs(m), 1.0)
            self.mu[pr, pk] = np.nan_to_num(mu)
            self.s2[pr, pk] = np.clip(np.nan_to_num(s2, nan=1.0), 1.0, self.clip)
            if self._inv_scale is not None:  # only these keys' spreads changed
                self._inv_scale[:, pr, pk] = _inv_scale(self.s2[pr, pk], self._n_base()[pr, pk])

    # --- plan changes -------------------------------------------------------------------------
    def remap(self, ranks: Sequence[int], moved: set[int]) -> None:
        """The plan's ranks are now ``ranks``; those in ``moved`` changed work: their ratios
        start again from the cost model's prediction with the spread they had (their noise
        is their device's and host's), and their recent deviations are forgotten."""
        old = {r: i for i, r in enumerate(self.ranks)}
        keep = {name: getattr(self, name) for name in ("hist", "hpos", "hcount", "m", "s", "s2", "mu", "top", "void", "zprev",
                                                      "zprev2", "eprev", "eprev2", "_fresh", "since")}
        rings = {name: getattr(self, name) for name in ("z", "e", "pending")}  # iteration axis first
        sums, esums, prior, zpos, measured = self.sums, self.esums, self._prior, self.zpos, self._measured
        self.ranks = tuple(ranks)
        self._alloc(len(self.ranks))
        self.zpos = zpos
        self._prior = np.full((len(self.ranks), self.kinds), self.prior_spread)
        self._measured = np.zeros((len(self.ranks), self.kinds), dtype=bool)
        for i, r in enumerate(self.ranks):
            j = old.get(r)
            if j is None:
                continue
            if r in moved:
                warm = keep["hcount"][j] >= self.min_samples
                self._prior[i] = np.where(warm, keep["s"][j] / np.maximum(keep["m"][j], 1e-9), prior[j])
                self.s[i] = self._prior[i]
                self._measured[i] = warm | measured[j]
                continue
            self._measured[i] = measured[j]
            for name, arr in keep.items():
                getattr(self, name)[i] = arr[j]
            for name, arr in rings.items():
                getattr(self, name)[:, i] = arr[:, j]
            self.sums[:, i] = sums[:, j]
            self.esums[:, i] = esums[:, j]


def _inv_scale(s2: FloatArray, n_base: npt.NDArray[np.int64]) -> FloatArray:
    """(scales, *keys): 1 / (s2 · √(w · (1 + 1.57·w/n))) for every scale w, the divisor of a
    window's sum of deviations (``test``), from the keys' spreads and baseline sizes."""
    shape = (len(SCALES),) + (1,) * s2.ndim
    w = W.reshape(shape)
    scale = np.sqrt(w * (1.0 + MEDIAN_VAR * w / n_base[None]))
    out: FloatArray = 1.0 / (s2[None] * scale)
    return out


def _mean_rows(a: FloatArray) -> FloatArray:
    """``np.mean(a, axis=1)``: the same sum and division, without its dispatch."""
    out: FloatArray = a.sum(axis=1) / a.shape[1]
    return out


def _nanmean_rows(a: FloatArray) -> FloatArray:
    """``np.nanmean(a, axis=1)`` (NaN where a row has none): the same steps — NaN replaced
    by 0, the row sums divided by the finite counts — without its dispatch."""
    mask = np.isnan(a)
    filled = np.array(a)
    np.copyto(filled, 0.0, where=mask)
    cnt = np.sum(~mask, axis=1, dtype=np.intp)
    out: FloatArray = filled.sum(axis=1) / cnt
    return out


def median_rows(a: FloatArray, complete: bool) -> FloatArray:
    """Row medians; ``complete``: no NaN, else NaN are ignored (rows have at least one
    finite value)."""
    n_cols = a.shape[1]
    if complete:  # the lower median: one partition point is half the work of two
        lo = (n_cols - 1) // 2
        return np.asarray(np.partition(a, lo, axis=1)[:, lo], dtype=np.float64)
    srt = np.sort(a, axis=1)  # NaN last
    n = np.isfinite(a).sum(axis=1)
    lo_i = np.maximum((n - 1) // 2, 0)
    hi_i = np.maximum(n // 2, 0)
    rows = np.arange(a.shape[0])
    return np.asarray(0.5 * (srt[rows, lo_i] + srt[rows, hi_i]), dtype=np.float64)


def narrower(a: NoiseModel, key_a: int, b: NoiseModel, key_b: int) -> BoolArray:
    """(n,) rows where key ``key_a`` of ``a`` has the narrower healthy relative spread than key
    ``key_b`` of ``b`` (models over the same ranks), ``b``'s judged and ``a``'s settled: of two
    estimators of one quantity, a shift by the same share shows sooner in the narrower. Chosen
    from the healthy windows, never from the value being judged: no second look at the data.
    The alternative ``a`` must rest on half a window: a spread from its first few samples was
    once a third of what it later read, and a rank was accused at its 25th iteration."""
    return np.asarray(a.settled()[:, key_a] & b.judged()[:, key_b]
                      & (a.relative_spread()[:, key_a] < b.relative_spread()[:, key_b]), dtype=np.bool_)
