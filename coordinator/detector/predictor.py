"""What an iteration should have cost: the detector's calibrated, vectorised predictor.

Per cost key (a layer range on a TP size and a chunk kind; a P2P hop; a DP ring) a
``LinearCost`` ``T = α·tokens + β·Σl² + γ`` is fitted online by the cost model's
``Calibrator`` from healthy timings (the TP group's median, so one sick member does not
teach the model its own slowness). Coefficients are cached in arrays and refitted every
``refit_every`` iterations, so a prediction for every op of every rank is three fused
multiply-adds over a [ranks, chunks, kinds, micro-batches] array. The predicted iteration
runs the compiled schedule (``detector.program``) over all replicas at once.

Re-warming after a plan change: rewarm.py.

Pure (numpy only), deterministic.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.evidence import BWD, FWD, IterationTimings, PlanIndex
from resihp.coordinator.detector.program import ScheduleProgram
from resihp.coordinator.detector.ratios import median, nanmedian
from resihp.coordinator.detector.rewarm import Rewarming
from resihp.coordinator.model.costmodel import Calibrator

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Predictor(Rewarming):
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
