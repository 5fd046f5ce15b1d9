"""What an iteration should have cost: the detector's calibrated, vectorised predictor.

Per cost key (a layer range on a TP size and a chunk kind; a P2P hop; a DP ring) a
``LinearCost`` ``T = α·tokens + β·Σl² + γ`` is fitted online by the cost model's
``Calibrator`` from healthy timings (the TP group's median, so one sick member does not
teach the model its own slowness). Coefficients are cached in arrays and refitted every
``refit_every`` iterations, so a prediction for every op of every rank is three fused
multiply-adds over a [ranks, chunks, kinds, micro-batches] array. The predicted iteration
runs the compiled schedule (``detector.program``) over all replicas at once.

Re-warming: after a plan change the detector tags the ranks whose work changed, so their
keys are new, and ``start_rewarm`` marks every key of the new plan that has no calibration
yet. Such a key learns from every sample offered (not a sampled few) for ``iters``
iterations that gave it samples and is then fitted on all of them (``tick_rewarm``); until
then the detector does not judge the evidence that depends on it (``rank_rewarm``).

Pure (numpy only), deterministic.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.evidence import BWD, FWD, IterationTimings, PlanIndex, group_all
from resihp.coordinator.detector.program import ScheduleProgram
from resihp.coordinator.detector.ratios import median, nanmedian
from resihp.coordinator.detector.seeds import Key, KeyShapes, seed_compute, seed_level, seed_p2p
from resihp.coordinator.model.costmodel import Calibrator

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Predictor:
    def __init__(self, index: PlanIndex, window: int = 256, min_samples: int = 8, refit_every: int = 25,
                 samples_per_key: int = 32, seed: int = 0) -> None:
        self.cal = Calibrator(window=window, min_samples=min_samples)
        self.refit_every = refit_every
        self.samples_per_key = samples_per_key
        self._rng = np.random.default_rng(seed)
        self._hist: dict[Hashable, deque[float]] = {}
        self._fits = 0
        self._since_refit = 0
        self._cursor = -1
        # key -> (learning iterations with samples still to come, learning iterations in a row without)
        self._rewarm: dict[Hashable, tuple[int, int]] = {}
        self._rw_iters = 1
        self._seeded: set[int] = set()  # keys priced by a seed (seeds.py), not yet by their own fit
        # bumped whenever the re-warming keys' pricing changes (a plan change, a seed checked
        # or replaced, a window's fit): an iteration priced before is priced another way
        self.pricing_epoch = 0
        self._interim: set[Hashable] = set()  # re-warming keys given an early fit for pricing
        self.iter_key: tuple[object, ...] = ("iter",)  # the job-level key (iteration-time evidence)
        self._fitted = 0  # bumped whenever A, B or G change (``_coefficients`` caches on it)
        self.reindex(index)

    def reindex(self, index: PlanIndex) -> None:
        """Adopt a new plan; calibration is kept per key, so unchanged stages stay ready."""
        self.index = index
        k = index.n_keys
        self.A = np.full(k, np.nan)
        self.B = np.full(k, np.nan)
        self.G = np.full(k, np.nan)
        self.level: FloatArray = np.full(k, np.nan)  # DP / OPT: median of recent healthy samples
        self._fitted += 1  # A, B, G replaced: cached coefficient gathers are stale
        self._seeded = set()
        self._cross_tp: set[int] = set()
        self._seed_kids: set[int] = set()  # re-warming keys priced by a seed of any kind
        self.pricing_epoch += 1
        self._coef: dict[str, tuple[int, FloatArray, FloatArray, FloatArray]] = {}  # op -> (version, α, β, γ)
        ix = index
        # TP-group member matrix [groups, max tp] (padded with the leader)
        width = int(ix.tp_size.max()) if ix.n else 1
        mem = np.tile(ix.group_leader[:, None], (1, width))
        fill = np.zeros(ix.n_groups, dtype=np.int64)
        for i in range(ix.n):
            g = int(ix.group_of[i])
            mem[g, fill[g]] = i
            fill[g] += 1
        self.members = mem
        self._ready_chunks = False
        self._gather_cache: dict[tuple[int, int], tuple[ScheduleProgram, IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]] | None = None
        self.step_key = {int(o): ("step",) + tuple(ix.keys[int(o)][1:]) for o in np.unique(ix.okey)}
        # per rank, the keys its compute evidence and its communication evidence (P2P in,
        # DP ring) depend on; -1 (no such op) indexes the False sentinel of rewarming masks
        n = ix.n
        self._ckeys = ix.ckey.reshape(n, -1)
        self._mkeys = np.concatenate([ix.pkey.reshape(n, -1), ix.dkey[:, None]], axis=1)
        known = set(ix.keys)
        self._rewarm = {key: val for key, val in self._rewarm.items() if key in known}
        self.rw_left = np.array([self._rewarm.get(key, (0, 0))[0] for key in ix.keys], dtype=np.int64)
        self.rw_idle = np.array([self._rewarm.get(key, (0, 0))[1] for key in ix.keys], dtype=np.int64)
        self._refit(force=True)

    # --- calibration ----------------------------------------------------------------------
    def _refit(self, force: bool = False) -> None:
        """Fit keys that became ready; otherwise refresh at most one stale key per call, so
        a robust refit (tens of ms) never lands on one iteration for every key at once.
        Re-warming keys are fitted once, at the end of their window (``tick_rewarm``)."""
        rounds_due = force or self._since_refit >= self.refit_every
        rw = self.rw_left > 0
        for kid, key in enumerate(self.index.keys):
            if key[0] in ("dp", "opt"):
                hist = self._hist.get(key)
                if hist and (rounds_due or np.isnan(self.level[kid])):
                    self.level[kid] = float(np.median(np.asarray(hist)))
            elif (force or np.isnan(self.A[kid])) and not rw[kid] and self.cal.ready(key):
                self._fit(kid)
        if force or self._since_refit < self.refit_every:
            return
        fittable = [k for k, key in enumerate(self.index.keys)
                    if key[0] not in ("dp", "opt") and not rw[k] and self.cal.ready(key)]
        if not fittable:
            return
        self._cursor = (self._cursor + 1) % len(fittable)
        self._fit(fittable[self._cursor])
        if self._cursor == len(fittable) - 1:
            self._since_refit = 0

    def refit_all(self) -> None:
        """Refit every ready key now (the end of warm-up: use all its samples)."""
        self._refit(force=True)

    def _fit(self, kid: int) -> None:
        model = self.cal.model(self.index.keys[kid])
        self.A[kid], self.B[kid], self.G[kid] = model.alpha, model.beta, model.gamma
        self._seeded.discard(kid)
        self._seed_kids.discard(kid)
        self._fitted += 1

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

    def _add(self, keys: IntArray, tok: FloatArray, ssq: FloatArray, dur: FloatArray, per_key: int,
             only: BoolArray | None, got: BoolArray) -> None:
        ok = (keys >= 0) & np.isfinite(dur) & (dur > 0) & np.isfinite(tok)
        if only is not None:
            ok &= only[keys]  # keys of -1 read the sentinel (False) at the end of ``only``
        if not ok.any():
            return
        keys, tok, ssq, dur = keys[ok], tok[ok], ssq[ok], dur[ok]
        order = np.lexsort((self._rng.random(len(keys)), keys))
        keys, tok, ssq, dur = keys[order], tok[order], ssq[order], dur[order]
        first = np.searchsorted(keys, keys, side="left")
        take = (np.arange(len(keys)) - first) < per_key
        got[keys[take]] = True
        names = self.index.keys
        for k, a, b, t in zip(keys[take].tolist(), tok[take].tolist(), ssq[take].tolist(), dur[take].tolist()):
            self.cal.add_features(names[k], a, b, t)

    def calibrate(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, healthy: npt.NDArray[np.bool_],
                  warm: bool, only: BoolArray | None = None) -> BoolArray:
        """Learn from this iteration's healthy ranks (warm=True: take everything offered);
        ``only``: the keys to learn (all when None). Returns which keys got samples."""
        ix = self.index
        groups = np.arange(ix.n_groups)
        if not warm and ix.n_groups > self.samples_per_key:
            groups = np.sort(self._rng.choice(ix.n_groups, self.samples_per_key, replace=False))
        got = self._learn(t, tok, ssq, healthy, groups, 10**9 if warm else self.samples_per_key, only, None, None)
        self._since_refit += 1
        self._refit()
        return got

    def _learn(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, healthy: npt.NDArray[np.bool_],
               groups: IntArray, per_key: int, only: BoolArray | None, div_c: FloatArray | None,
               div_m: FloatArray | None) -> BoolArray:
        """Add samples of ``groups`` (TP-group medians over healthy members) to the keys
        in ``only``; ``div_c`` / ``div_m`` divide a rank's compute / communication times
        (a confirmed-slow rank's factor: what a healthy device would have taken)."""
        ix = self.index
        got = np.zeros(ix.n_keys + 1, dtype=bool)  # + the sentinel of key -1
        sel = None if only is None else np.append(only, False)
        leader = ix.group_leader[groups]
        rep = ix.rep[leader]
        members = self.members[groups]
        if t.compute is not None and t.p2p is not None:
            for arr, keys, div in ((t.compute, ix.ckey, div_c), (t.p2p, ix.pkey, div_m)):
                vals = arr[members]
                if div is not None:
                    vals = vals / div[members][:, :, None, None, None]
                vals = np.where(healthy[members][:, :, None, None, None], vals, np.nan)
                med = nanmedian(vals, axis=1)  # [G, V, k, M]
                shape = med.shape
                kk = np.broadcast_to(keys[leader][:, :, :, None], shape)
                tk = np.broadcast_to(tok[rep][:, None, None, :], shape)
                sk = np.broadcast_to(ssq[rep][:, None, None, :], shape)
                self._add(kk.ravel(), tk.ravel(), sk.ravel(), med.ravel(), per_key, sel, got)
            for tail, tkeys, div in ((t.dp, ix.dkey, div_m), (t.opt, ix.okey, div_c)):
                if tail is None:
                    continue
                # the sampled groups' healthy members, one median per key
                vals = tail[members] if div is None else tail[members] / div[members]
                vals = np.where(healthy[members], vals, np.nan).ravel()
                kk = tkeys[members].ravel()
                ok = np.isfinite(vals)
                if sel is not None:
                    ok &= sel[kk]
                for kid in np.unique(kk[ok]).tolist():
                    hist = self._hist.setdefault(ix.keys[kid], deque(maxlen=64))
                    hist.append(median(vals[ok & (kk == kid)]))
                    got[kid] = True
        elif t.rank_step is not None:
            tot, sq = np.nansum(tok, axis=1), np.nansum(ssq, axis=1)
            okey = ix.okey
            steps = t.rank_step if div_c is None else t.rank_step / div_c
            dur = np.where(healthy, steps, np.nan)
            # one sample per stage key and replica is plenty
            pick = np.unique(okey * (ix.rep.max() + 1) + ix.rep, return_index=True)[1]
            for i in pick.tolist():
                o = int(okey[i])
                if np.isfinite(dur[i]) and dur[i] > 0 and (sel is None or sel[o]):
                    self.cal.add_features(self.step_key[o], float(tot[ix.rep[i]]), float(sq[ix.rep[i]]), float(dur[i]))
                    got[o] = True
        else:
            tot, sq = np.nansum(tok, axis=1), np.nansum(ssq, axis=1)
            d = int(np.argmax(sq))
            self.cal.add_features(self.iter_key, float(tot[d]), float(sq[d]), t.time_s)
        out: BoolArray = got[:-1]
        return out

    # --- re-warming after a plan change ---------------------------------------------------------
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

    # --- readiness ------------------------------------------------------------------------
    def ready(self, level: str) -> bool:
        """Whether every key the level's evidence uses is fitted; keys in their re-warm
        window do not count (the detector does not judge evidence that uses them)."""
        ix = self.index
        rw = self.rw_left > 0
        if level == "chunks":
            if self._ready_chunks:
                return True
            used = np.unique(ix.ckey[ix.ckey >= 0])
            used = used[~rw[used]]
            # a kind the loop never times (an own loop timing its forwards only) is not waited for
            timed = np.array([self.cal.samples(ix.keys[int(k)]) > 0 for k in used], dtype=bool)
            if timed.any():
                used = used[timed]
            ok = bool(np.all(np.isfinite(self.A[used])))
            self._ready_chunks = ok and not rw.any()  # cached only once nothing re-warms
            return ok
        if level == "rank_step":
            return all(self.cal.ready(k) for o, k in self.step_key.items() if not rw[o])
        return self.cal.ready(self.iter_key)

    # --- predictions ----------------------------------------------------------------------
    def _linear(self, op: str, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        """The keys of ``op`` ("compute": ``ckey``, "p2p": ``pkey``; [n, V, k]) x features of
        the rank's replica [D, M] -> [groups, V, k, M]: TP
        members share a prediction, so it is computed per (replica, stage) group (its
        leader's keys); ``PlanIndex.group_of`` maps ranks to rows."""
        ix = self.index
        a, b, g = self._coefficients(op)
        rep = ix.rep[ix.group_leader]
        t = tok[rep][:, None, None, :]
        s = ssq[rep][:, None, None, :]
        per_group: FloatArray = a * t + b * s + g
        return per_group

    def _coefficients(self, op: str) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(α, β, γ) of every group's keys of ``op`` [groups, V, k, 1] (α NaN where there is
        no key), cached until a key is fitted again: they change a few times per hundred
        iterations, the predictions every iteration."""
        cached = self._coef.get(op)
        if cached is not None and cached[0] == self._fitted:
            return cached[1], cached[2], cached[3]
        keys = self.index.ckey if op == "compute" else self.index.pkey
        gk = keys[self.index.group_leader]
        safe = np.where(gk >= 0, gk, 0)
        a = np.where(gk >= 0, self.A[safe], np.nan)[..., None]
        b = self.B[safe][..., None]
        g = self.G[safe][..., None]
        self._coef[op] = (self._fitted, a, b, g)
        return a, b, g

    def compute_groups(self, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        """Predicted compute op times per TP group [groups, V, 3, M]."""
        return self._linear("compute", tok, ssq)

    def p2p_groups(self, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        """Predicted inbound P2P times per TP group [groups, V, 2, M]."""
        return self._linear("p2p", tok, ssq)

    def compute(self, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        """Predicted compute op times per rank [n, V, 3, M]."""
        out: FloatArray = np.take(self.compute_groups(tok, ssq), self.index.group_of, axis=0)
        return out

    def p2p(self, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        """Predicted inbound P2P times per rank [n, V, 2, M]."""
        out: FloatArray = np.take(self.p2p_groups(tok, ssq), self.index.group_of, axis=0)
        return out

    def dp(self) -> FloatArray:
        out: FloatArray = self.level[self.index.dkey]
        return out

    def opt(self) -> FloatArray:
        out: FloatArray = self.level[self.index.okey]
        return out

    def rank_step(self, tok: FloatArray, ssq: FloatArray) -> FloatArray:
        ix = self.index
        tot, sq = np.nansum(tok, axis=1)[ix.rep], np.nansum(ssq, axis=1)[ix.rep]
        out = np.full(ix.n, np.nan)
        for o, key in self.step_key.items():
            if self.cal.ready(key):
                m = self.cal.model(key)
                sel = ix.okey == o
                out[sel] = m.alpha * tot[sel] + m.beta * sq[sel] + m.gamma
        return out

    def iteration_only(self, tok: FloatArray, ssq: FloatArray) -> float:
        tot, sq = np.nansum(tok, axis=1), np.nansum(ssq, axis=1)
        d = int(np.argmax(sq))
        return self.cal.model(self.iter_key).predict(float(tot[d]), float(sq[d]))

    def _gathers(self) -> dict[tuple[int, int], tuple[ScheduleProgram, IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]]:
        """Per compiled schedule: which replicas run it and, per op, its TP group (the row
        of the per-group predictions) and indices into the prediction arrays. Built once
        per plan."""
        if self._gather_cache is not None:
            return self._gather_cache
        ix = self.index
        gid = {key: g for g, key in enumerate(ix.group_key)}
        out = {}
        for shape, prog in ix.programs.items():
            reps = np.array([d for d, s in enumerate(ix.rep_program) if s == shape], dtype=np.int64)
            _, dev, kind, mb, vstage = ix.program_gather(shape)
            chunk = vstage // shape[0]
            rows = np.array([[gid[(int(d), int(s))] for s in dev] for d in reps], dtype=np.int64)
            dirs = np.where(kind == 0, FWD, BWD)
            out[shape] = (prog, reps, rows, chunk[None, :], kind[None, :], mb[None, :], dirs[None, :])
        self._gather_cache = out
        return out

    def _schedule_ends(self, pred_compute: FloatArray, pred_p2p: FloatArray) -> Iterator[tuple[IntArray, IntArray, FloatArray]]:
        """Per compiled schedule: (its replicas, each op's TP group, each op's end time)
        with the given per-group op and transfer times (``compute_groups``, ``p2p_groups``)."""
        for _shape, (prog, reps, rows, chunk, kind, mb, dirs) in self._gathers().items():
            dur = pred_compute[rows, chunk, kind, mb]
            hop = np.nan_to_num(pred_p2p[rows, chunk, dirs, mb])
            _, end = prog.evaluate(np.nan_to_num(dur), hop)
            yield reps, rows, end

    def iteration_by_rank(self, pred_compute: FloatArray, pred_p2p: FloatArray, dp: FloatArray,
                          opt: FloatArray) -> float:
        """Predicted iteration seconds with each rank's own tail: the latest over ranks of
        (its TP group's last op end in the schedule + its DP all-reduce + its optimizer step).
        Finer than ``iteration`` (which adds the largest tail to the longest pipeline), for
        pricing a slowdown whose ring or stage has slack. Op and transfer times per group."""
        ix = self.index
        ends = np.zeros(ix.n_groups)
        for _reps, rows, end in self._schedule_ends(pred_compute, pred_p2p):
            np.maximum.at(ends, rows.ravel(), end.ravel())
        return float(np.max(ends[ix.group_of] + np.nan_to_num(dp) + np.nan_to_num(opt)))

    def iteration(self, pred_compute: FloatArray, pred_p2p: FloatArray) -> tuple[float, FloatArray]:
        """(predicted iteration seconds, predicted pipeline makespan per replica) with every
        device healthy: the schedule over predicted op and hop times (per group), then DP and
        optimizer."""
        span = np.zeros(len(self.index.plan.replicas))
        for reps, _rows, end in self._schedule_ends(pred_compute, pred_p2p):
            span[reps] = end.max(axis=1)
        tail = np.nan_to_num(self.dp()) + np.nan_to_num(self.opt())
        return float(span.max() + tail.max()), span
