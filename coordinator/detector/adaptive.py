"""Noise-adaptive judging of a rank's compute and links (the detector's default; docs/detector.md).

Each evidence key learns its healthy spread (``noise.NoiseModel``). A rank's compute is read
two ways: the ratio of sums of its ops, and — while some rank's ratio of sums is noisier than
``FLOOR_WORTH`` per iteration — the least stretched op (``ratios.floor_ratio``), which has its
own noise model. Each rank is judged on the estimator whose healthy spread is the narrower,
and a crossing of the least stretched op counts only where the ratio of sums agrees. Before
either, a slowdown common to the iteration's ranks or to a host's is taken off. ``Detector``
inherits this through ``IterationJudge``. Pure.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.config import DetectorConfig
from resihp.coordinator.detector.evidence import PlanIndex, host_stats, small_host_shift
from resihp.coordinator.detector.noise import MEDIAN_VAR, NoiseModel, median_rows, narrower
from resihp.coordinator.detector.ratios import fill_nan, median
from resihp.coordinator.detector.verdicts import RankState

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
MEDIAN_SE = float(np.sqrt(MEDIAN_VAR))  # a sample median's standard error over the mean's (Gaussian noise)
# a rank's compute noise (relative spread of its ratio of sums, per iteration) above which the
# least-stretched-op estimator is worked out as well
FLOOR_WORTH = 0.03
# a finding on the least stretched op needs the ratio of sums to show this share of its excess
SHARE_AGREES = 0.5
# a severe compute slowdown is found in two iterations: each beyond the level, each at least
# this relative excess in the ratio of sums *and* in the least stretched op. Every op slower by
# half is a device, not a stall: a GC pause or a loader stall stretches one op (the trimmed
# ratio drops the worst), never the fastest. The shift test's three-in-a-row jump stays for
# the rest: 2-3x compute fail-slows ran the job at 0.29-0.44 of its rate for that third
# iteration (the simulator's harsh mix)
SEVERE = 0.5
# iterations of the common factor remembered for the iterations in which fewer than three ranks
# have evidence (the others' keys re-warm after a plan change moved their work). On shared
# cores the calibrated model reads the ranks 1.2-2x its prediction in common (it fits the
# unstretched ops); a factor of 1 there made a healthy rank of an unchanged replica read 1.5x
# slow for the few iterations its peers re-warmed, and a re-plan followed (bench/real_runs.py,
# a dp-shares change for a throttled peer)
COMMON_MEMORY = 16
# a compute baseline more than this many of its own standard errors (and the effect floor) above
# the median baseline of the ranks that do the same work is held at that bound (``PeerAnchor``)
PEER_LEVEL = 4.0
# the fewest ranks doing the same work (with judged baselines) for their median to be the
# healthy level: of two, either may be the slow one
PEER_MIN = 3


def peer_groups(ckey: npt.NDArray[np.int64]) -> IntArray:
    """(groups, size) positions of the ranks that do the same compute work (identical compute
    cost keys: the same layers on the same TP size, in other DP replicas), -1 padded; only
    groups of ``PEER_MIN`` or more. ``ckey``: PlanIndex.ckey."""
    n = ckey.shape[0]
    if n == 0:
        return np.zeros((0, 0), dtype=np.int64)
    _, inverse = np.unique(ckey.reshape(n, -1), axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    members = [np.flatnonzero(inverse == g) for g in range(int(inverse.max()) + 1)]
    members = [m for m in members if len(m) >= PEER_MIN]
    out = np.full((len(members), max((len(m) for m in members), default=0)), -1, dtype=np.int64)
    for g, m in enumerate(members):
        out[g, :len(m)] = m
    return out


def anchor_to_peers(model: NoiseModel, groups: IntArray, floor: float, key: int = 0) -> npt.NDArray[np.bool_]:
    """Hold each compute baseline of ``model`` (column ``key``) at most ``PEER_LEVEL`` of its
    standard errors (and at least the effect ``floor``) above the median baseline of the
    ranks doing the same work (``groups``, ``peer_groups``); returns the rows held.

    Why: a key learns its baseline from its own first iterations, so a device slow from the
    job's start (or from within its warm-up) had its slowdown for a baseline and was never
    found, even at 3x (an outsider trace with the fault at iteration 0). Ranks that do the same
    work on the same predicted time are each other's reference: a rank whose healthy level
    sits far above theirs is slow, not differently healthy. Its own relative spread stays (its
    noise is its device's, and scales with its op times). The standard error is a median's, of
    each side's samples: a wide bound on shared cores (±20-27 % per iteration: a CPU rank must
    sit 18-35 % above its peers), the effect floor on quiet GPUs."""
    held = np.zeros(model.m.shape[0], dtype=np.bool_)
    if groups.size == 0:
        return held
    m = model.m[:, key]
    judged = model.judged()[:, key]
    vals = np.where((groups >= 0) & judged[groups], m[groups], np.nan)
    count = np.isfinite(vals).sum(axis=1)
    ok = count >= PEER_MIN
    if not ok.any():
        return held
    ref = np.full(len(count), np.nan)
    ref[ok] = median_rows(vals[ok], complete=False)
    rank_ref = np.full(len(m), np.nan)
    rank_cnt = np.ones(len(m))
    flat, grp = groups.reshape(-1), np.repeat(np.arange(len(groups)), groups.shape[1])
    real = flat >= 0
    rank_ref[flat[real]] = ref[grp[real]]
    rank_cnt[flat[real]] = count[grp[real]]
    n = model.samples()[:, key].astype(np.float64)
    se = MEDIAN_SE * model.relative_spread()[:, key] * np.sqrt((1.0 + 1.0 / rank_cnt) / n)
    cap = rank_ref * (1.0 + np.maximum(floor, PEER_LEVEL * se))
    held = judged & np.isfinite(cap) & (m > cap)
    if held.any():
        # its spread in proportion: a device's jitter scales with its op times, so the healthy
        # device it is held against would show this share of it. Kept absolute, a 2x rank's
        # spread read twice its peers' (in units of the held baseline) and on shared cores a
        # 2x rank slow from the start was found after 156 iterations
        model.s[held, key] *= cap[held] / m[held]
        model.m[held, key] = cap[held]
    return held


class AdaptiveJudging:
    """The noise-adaptive part of ``IterationJudge`` (module docstring)."""

    # the detector's state this part reads and writes (set by Detector.__init__ and _alloc)
    config: DetectorConfig
    index: PlanIndex
    state: npt.NDArray[np.int64]  # RankState of every rank of the plan, by PlanIndex position
    noise: NoiseModel  # per-key healthy spreads: compute (ratio of sums), links
    floor_noise: NoiseModel  # ... of compute as the least stretched op, while it is worked out
    _floor_rows: npt.NDArray[np.bool_]  # ranks whose compute the latest test judged by the least stretched op
    _floor_x: FloatArray | None  # (n, 1) the latest iteration's least-stretched-op ratios, if worked out
    _floor_fed: bool = False  # the floor model was tested in the previous iteration (its windows are current)
    _g_keys: tuple[FloatArray, FloatArray | None]  # the latest shift statistics of both models' keys
    _far: npt.NDArray[np.bool_]  # (n, 2) the latest iteration alone far out: compute (as judged), communication
    _severe_prev: npt.NDArray[np.bool_]  # (n,) the previous iteration was a severe compute slowdown (SEVERE)
    # per compute estimator ("sums", "floor"): its latest common factors (COMMON_MEMORY); they
    # outlive plan changes, as the machine's load and the model's common error do
    _commons: dict[str, deque[float]]
    _peers: IntArray  # peer_groups of the current plan (set by Detector._alloc)

    def _adaptive_chunks(self, comp: FloatArray, low: FloatArray | None, comm: FloatArray,
                         low_of: Callable[[IntArray], FloatArray] | None = None
                         ) -> tuple[FloatArray, FloatArray, tuple[FloatArray, FloatArray, FloatArray]]:
        """Chunk-level evidence through the test: compute as the ratio of sums (``comp``) and as
        the least stretched op (``low``, None where not worked out), communication (``comm``).
        ``low_of(rows)``: the least stretched op of a few ranks, before any common shift is
        taken off (the severe-slowdown check asks it where ``low`` was not worked out).
        Returns (compute with the iteration's and the host's common shift taken off; the (n, 2)
        evidence the baselines learn; ``_noise_test``'s three arrays)."""
        common = self._peer_factor(comp, "sums")
        comp, host_comp = self._host_noise(comp / common, self.noise)
        x = np.stack([comp, comm], axis=1)
        host_noise = np.stack([host_comp, np.full(len(comp), np.nan)], axis=1)
        floor = None
        if low is not None:
            low, host_low = self._host_noise(low / self._peer_factor(low, "floor"), self.floor_noise)
            floor = (low[:, None], host_low[:, None])
        out = self._noise_test(x, host_noise, floor)
        self._severe(comp, low, low_of, common, out[0])
        return comp, x, out

    def _severe(self, comp: FloatArray, low: FloatArray | None, low_of: Callable[[IntArray], FloatArray] | None,
                common: float, ex: FloatArray) -> None:
        """Find a severe compute slowdown at its second iteration (``SEVERE``): in this
        iteration and the previous one the ratio of sums (``comp``, common shifts taken off)
        was beyond the level and ``SEVERE`` above its baseline, and so was every op (the least
        stretched one: ``low``, or ``low_of`` for the candidates, divided by the iteration's
        ``common`` factor). Marks such ranks suspect in ``ex`` (compute column, in place)."""
        nz = self.noise
        m = nz.m[:, 0]
        cand = np.nonzero(nz.far[:, 0] & (comp >= (1.0 + SEVERE) * m))[0]
        sev = np.zeros(len(comp), dtype=np.bool_)
        if len(cand):
            if low is not None:
                fastest = low[cand]
            elif low_of is not None:
                fastest = low_of(cand) / common
            else:
                fastest = np.full(len(cand), np.nan)
            sev[cand] = fill_nan(fastest, 0.0) >= (1.0 + SEVERE) * m[cand]
        both = sev & self._severe_prev
        self._severe_prev = sev
        if both.any():
            # in spreads beyond the level: the smaller of the two iterations' deviations
            dev = np.minimum(nz.zprev[both, 0], nz.zprev2[both, 0]) / nz.s2[both, 0] - nz.level
            ex[both, 0] = np.maximum(ex[both, 0], np.maximum(dev, 1e-6))

    def _peer_factor(self, comp: FloatArray, estimator: str) -> float:
        """The median compute ratio of the iteration's live ranks with evidence, both ways: a
        slowdown (co-tenant load on a shared host) or speed-up common to the ranks is no
        device's fault and no re-plan routes around it. Slow ranks count too: the median
        stands while fewer than half are slow, and leaving them out would let the peers
        dwindle to a few. With fewer than three (a median of two is one of them): the median
        of the ``estimator``'s latest factors (``COMMON_MEMORY``), 1 where there are none."""
        hist = self._commons.setdefault(estimator, deque(maxlen=COMMON_MEMORY))
        peers = (self.state != RankState.DEAD) & np.isfinite(comp)
        common = median(comp[peers]) if int(peers.sum()) >= 3 else 0.0
        if common > 0:
            hist.append(common)
            return common
        return median(np.asarray(hist)) if hist else 1.0

    def _host_noise(self, comp: FloatArray, model: NoiseModel) -> tuple[FloatArray, FloatArray]:
        """What a loaded host does to its ranks' compute ratios this iteration, from the ranks
        of each host (the median of four or more; of two or three, the smallest slowdown they
        share): (the ratios with a common shift of the host below the effect floor taken off,
        (n,) relative spread among the host's ranks). ``model``: the noise model whose first
        key is this compute estimator. A co-tenant slows and jitters a whole host by a few per cent,
        which no re-plan around one device would help; a larger common shift stays (a
        throttled host is a fault), as does any one device's own slowdown."""
        m = model.m[:, 0]
        rel = (comp - m) / m
        center, spread = host_stats(rel, self.index.host_rows)
        center = np.where(np.isfinite(center), center, small_host_shift(rel, self.index.host_rows))
        small = np.isfinite(center) & (np.abs(center) < self.config.effect_floor)
        return np.where(small, comp - center * m, comp), spread

    def _floor_worth(self) -> bool:
        """Whether the least-stretched-op estimator is worth its cost (it and its noise model
        took 1-1.5 ms per iteration at 4096 ranks): while some rank's ratio of sums is noisier
        than FLOOR_WORTH per iteration. Below that a 1.1x slowdown already stands out by three
        spreads in every iteration (quiet GPUs); on shared cores the ratio swings ±7-16 %."""
        nz = self.noise
        return bool(np.any(nz.relative_spread()[:, 0] > FLOOR_WORTH))

    def _noise_test(self, x: FloatArray, spread_now: FloatArray | None = None,
                    floor: tuple[FloatArray, FloatArray] | None = None) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(excess over the level where a key is suspect, else -1; recent mean deviation; the
        shift statistic), each (n, 2): compute, communication. ``floor``: compute as the least
        stretched op and its host spread, each (n, 1), where worked out; then each rank's
        compute is judged on the estimator whose healthy spread, relative to its baseline, is
        the narrower (``noise.narrower``): a slowdown moves both by the same share, so the
        narrower shows it in fewer iterations."""
        g, excess, recent = self.noise.test(x, spread_now)
        ex = np.where(self.noise.suspect(g, excess), g - self.noise.level, -1.0)
        far = self.noise.far.copy()
        self._g_keys, self._floor_x = (g, None), None
        fr = np.zeros(len(x), dtype=np.bool_)
        if floor is not None:
            fl = self.floor_noise
            if not self._floor_fed:  # deviations pushed before a pause are not this run's
                fl.clear_windows(np.ones(len(x), dtype=np.bool_))
            gl, el, rl = fl.test(*floor)
            self._g_keys, self._floor_x = (g, gl), floor[0]
            fr = narrower(fl, 0, self.noise, 0)
            g, recent = g.copy(), recent.copy()
            # a slow device stretches its fastest op and its total by one share: the ratio of
            # sums must show at least half the excess over the window the floor crossed in. On
            # shared cores the least stretched op alone drifted 8-40 % for tens of iterations
            # (a co-tenant, other ranks' phases) while the ratio of sums held within 4 %
            agree = self.noise.window_excess(fl.crossed[:, 0], 0) >= np.maximum(
                self.config.effect_floor, SHARE_AGREES * el[:, 0])
            sus_fl = fl.suspect(gl, el)[:, 0] & agree
            ex[fr, 0] = np.where(sus_fl[fr], gl[fr, 0] - fl.level, -1.0)
            g[fr, 0], recent[fr, 0], far[fr, 0] = gl[fr, 0], rl[fr, 0], fl.far[fr, 0]
        self._floor_fed = floor is not None
        self._floor_rows, self._far = fr, far
        return ex, recent, g

    def _noise_normal(self, recent: FloatArray, link_slow: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """A slow rank counts as normal again when the recent mean deviation of the evidence
        it was found on is within half a spread of its healthy baseline, over RECENT iterations
        judged since its windows were last emptied (a plan change that moved it empties them).
        Half a spread is widened by the baseline's own uncertainty (a median of few samples);
        a mean excess under half the effect floor counts as back too (a very steady key's
        baseline from few samples can sit a fraction of a per cent off: no slowdown that
        small was ever a finding)."""
        rows = np.arange(len(link_slow))
        col = np.where(link_slow, 1, 0)
        key = recent[rows, col]
        nz, fl, fr = self.noise, self.floor_noise, self._floor_rows & ~link_slow  # fr: judged on the floor
        excess = np.where(fr, fl.recent_excess[:, 0], nz.recent_excess[rows, col])
        tolerance = np.where(fr, fl.recent_tolerance()[:, 0], nz.recent_tolerance()[rows, col])
        back = (key < 0.5 * tolerance) | (excess < 0.5 * self.config.effect_floor)
        return np.asarray(back & np.where(fr, fl.recent_known(), nz.recent_known()), dtype=np.bool_)

    def _noise_learn(self, x: FloatArray) -> None:
        """Every rank not found slow teaches its baselines, whatever this iteration's value:
        learning only the calm iterations would teach a spread narrower than the noise."""
        ok = ((self.state == RankState.HEALTHY) | (self.state == RankState.SUSPECT))[:, None]
        g, g_floor = self._g_keys
        self.noise.learn(x, np.broadcast_to(ok, x.shape), g)
        anchor_to_peers(self.noise, self._peers, self.config.effect_floor)
        if self._floor_x is not None and g_floor is not None:
            self.floor_noise.learn(self._floor_x, ok, g_floor)
            anchor_to_peers(self.floor_noise, self._peers, self.config.effect_floor)
