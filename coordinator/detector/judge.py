"""How the detector judges one iteration: per-rank evidence at each level, the state machine.

Chunk timings give compute and link ratios per rank, per-rank step times a step ratio, the
iteration time alone a job-level ratio (module docstring of ``detector``); each level marks
ranks suspect or normal, and ``_advance`` moves every rank through healthy → suspect → slow
→ healthy at once (numpy over ranks), grouping the transitions into findings. ``Detector``
inherits this; it is split out only to keep modules small. Pure.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.adaptive import AdaptiveJudging
from resihp.coordinator.detector.cost import FindingCost
from resihp.coordinator.detector.drift import FactorDrift
from resihp.coordinator.detector.evidence import (
    BWD,
    FWD,
    IterationTimings,
    group_all,
    shadowed_by_tp_partner,
    tp_wait_share,
)
from resihp.coordinator.detector.paths import (
    QuietPaths,
    path_evidence,
    pipeline_end_culprit,
    rings_outside_slow_nics,
)
from resihp.coordinator.detector.predictor import Predictor
from resihp.coordinator.detector.ratios import fill_nan, floor_ratio, median, nanmedian, priced_ratio, trimmed_ratio
from resihp.coordinator.detector.recovery_window import RecoveryWindow
from resihp.coordinator.detector.seeds import PauseShare
from resihp.coordinator.detector.verdicts import Finding, FindingKind, RankState

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


@dataclass
class JobTrack:
    """Iteration-level (job-wide) evidence: a trace without per-rank timings."""

    run: int = 0
    ok: int = 0
    slow: bool = False
    factor: float = 1.0


class IterationJudge(AdaptiveJudging, FindingCost):
    """The detector's judging of one iteration at its evidence level (module docstring)."""

    # the detector's state this part reads and writes (set by Detector.__init__ and _alloc)
    predictor: Predictor
    run: npt.NDArray[np.int64]  # consecutive suspect iterations, compute
    run_m: npt.NDArray[np.int64]  # the same, communication
    ok_run: npt.NDArray[np.int64]  # consecutive normal iterations of a slow rank
    score: FloatArray  # a slow rank's factor
    cause_code: npt.NDArray[np.int64]  # 1 where a rank's slowdown is its links
    last: dict[str, float]
    _dp_only: npt.NDArray[np.bool_]
    # a rank whose P2P stays inside its node, with a slow path this iteration (paths.py): its
    # evidence is that path, so it is named alone, not with its DP ring
    _path_end: npt.NDArray[np.bool_]
    _via_path: set[int]  # ranks found link-slow on such a path (named alone until they recover)
    _quiet_paths: QuietPaths  # whose intra-node paths are quiet enough to be judged (paths.py)
    _slow_at: dict[int, float]
    _lapses: dict[int, tuple[float, float]]  # idle.py: per rank, its fault's onset and latest lapse
    end_lapses_judged_normal: Callable[[npt.NDArray[np.bool_]], None]  # idle.py
    _pending: tuple[FloatArray, FloatArray] | None
    _job: JobTrack
    _rw_from: int
    # the last judged iterations' predictions (per TP group) and observed iteration seconds
    _recent: deque[tuple[FloatArray, FloatArray, float]]
    _tp_evidence: bool = False  # the latest judged iteration had TP collective spans
    _pauses: PauseShare  # what the schedule leaves out of an iteration (predicted_iteration_s)
    _pauses_epoch: int = 0  # the predictor's pricing epoch the gap was learnt under
    _pending_pricing: tuple[int, bool] = (0, False)  # (pricing epoch, seeds pending) of _pending
    _level: str  # the evidence level being judged (chunks, rank_step, iteration)
    _recovery: RecoveryWindow | None = None  # a link-slow rank's recent evidence (fixed thresholds)
    _drift: FactorDrift  # each slow rank's factor since its finding (drift.py)

    def _judge_chunks(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, now: float) -> list[Finding]:
        assert t.compute is not None and t.p2p is not None
        ix, pred, c = self.index, self.predictor, self.config
        # per TP group (members share a prediction); trimmed_ratio reads a rank's through group_of
        p_comp = pred.compute_groups(tok, ssq)
        p_p2p = pred.p2p_groups(tok, ssq)
        k = 3 if ix.split_backward else 2  # without split backward there are no W ops
        ops, p_ops = t.compute[:, :, :k], p_comp[:, :, :k]
        comp = trimmed_ratio(ops, p_ops, ix.group_of)
        # the least stretched op: the adaptive test's second compute estimator, worked out
        # only while some rank's compute is noisy enough for it to matter (_floor_worth)
        floor_on = c.adaptive and self._floor_worth()
        low = floor_ratio(ops, p_ops, ix.group_of) if floor_on else None
        self._tp_evidence = t.tp_wait is not None
        share = np.ones(ix.n)  # what of a rank's spans is its own compute (below)
        if t.tp_wait is not None:  # wall spans coupled by TP collectives: not the waiting members' compute
            share = tp_wait_share(ops, t.tp_wait, ix)
            comp = comp * share
            low = None if low is None else low * share
        if c.peer_relative:
            comp = comp / self._common_factor(comp)
            low = None if low is None else low / self._common_factor(low)
        in_f, in_b = trimmed_ratio(t.p2p, p_p2p, ix.group_of, parts=2)[[FWD, BWD]]  # inbound before F, before B
        dp_ratio = priced_ratio(t.dp, pred.dp()) if t.dp is not None else np.full(ix.n, np.nan)
        hold = None
        if pred.rewarming:  # evidence on a re-warming key says nothing yet
            rw_c, rw_m, _ = pred.rank_rewarm()
            comp = np.where(rw_c, np.nan, comp)
            low = None if low is None else np.where(rw_c, np.nan, low)
            in_f, in_b, dp_ratio = (np.where(rw_m, np.nan, x) for x in (in_f, in_b, dp_ratio))
            hold = np.where(self.cause_code > 0, rw_m, rw_c)
        out_f = np.where(ix.fwd_recv >= 0, in_f[ix.fwd_recv], np.nan)
        out_b = np.where(ix.bwd_recv >= 0, in_b[ix.bwd_recv], np.nan)
        # a slow NIC slows every cross-node transfer of its rank: P2P in and out, and its DP
        # ring. Both ends of a slow P2P link see it; the culprit is slow in every direction,
        # a neighbour only in those that touch the culprit: take the smallest ratio.
        dirs = np.stack([
            np.where(ix.cross_bwd, in_f, np.nan), np.where(ix.cross_fwd, in_b, np.nan),
            np.where(ix.cross_fwd, out_f, np.nan), np.where(ix.cross_bwd, out_b, np.nan),
        ])
        has = np.isfinite(dirs)
        self._dp_only = ~np.asarray(has.any(axis=0), dtype=np.bool_)  # (4, n) -> (n,), never a scalar
        link = np.where(self._dp_only, np.nan, np.min(np.where(has, dirs, np.inf), axis=0))
        # a path between two stages; inside a node too where such paths are quiet (paths.py)
        path = path_evidence(dirs, np.stack([in_f, in_b, out_f, out_b]), ix, c.comm_threshold, self._quiet_paths,
                             self.state == RankState.HEALTHY) if c.adaptive else np.full(ix.n, np.nan)
        link = np.fmax(link, path)
        # a rank that talks inside its node only is judged on its DP ring, or on a slow path
        # to a neighbouring stage where one shows (a TP4 x PP2 replica in one 8-GPU node: a
        # degraded NVLink between its stages was never found)
        self._path_end = self._dp_only & np.isfinite(path)
        comm = np.where(self._dp_only, np.where(self._path_end, np.fmax(dp_ratio, path), dp_ratio), link)
        comm = pipeline_end_culprit(comm, link, dp_ratio, ix, c.comm_threshold, c.adaptive)
        # the schedule simulation of the whole iteration is not needed to judge ranks; it
        # runs when a finding quotes it or a caller asks (predicted_iteration_s)
        self._pending = (p_comp, p_p2p)
        self._pending_pricing = (self.predictor.pricing_epoch, self.predictor.seeds_pending)
        self._recent.append((p_comp, p_p2p, t.time_s))  # what a finding's cost is averaged over
        self.last = {"observed_iteration_s": t.time_s}
        comm_thr = np.where(self._dp_only, c.dp_threshold, c.comm_threshold)
        adapt = None
        x: FloatArray | None = None  # the adaptive test's evidence: (n, 2) compute, communication
        if not c.adaptive:  # fixed thresholds (the adaptive test gives its own excesses)
            ex_c = fill_nan(comp - 1.0 - c.slow_threshold, -1.0)
            ex_m = fill_nan(comm - 1.0 - comm_thr, -1.0)
        else:
            def low_of(rows: npt.NDArray[np.int64]) -> FloatArray:  # a few ranks' least stretched op
                return floor_ratio(ops[rows], p_ops, ix.group_of[rows]) * share[rows]
            # (with peer_relative the candidates' fastest op would need that division too: not asked)
            comp, x, adapt = self._adaptive_chunks(comp, low, comm, None if c.peer_relative else low_of)
            ex_c, ex_m = adapt[0][:, 0], adapt[0][:, 1]
        if not c.link_detection:
            comm = np.ones_like(comm)
            ex_m = np.full_like(ex_m, -1.0)
            if x is not None:
                x = np.stack([comp, comm], axis=1)  # what the baselines learn (below)
        is_comm = ex_m > ex_c
        # the slowdown estimate of a link: the middle of its directions (the min, used to
        # decide, is biased low by the noise of the others), or its DP ring's when that is
        # slow too and slower: activations are small messages, where latency and a shaper's
        # burst hide much of a bandwidth loss, the ring's all-reduce is bulk — and the
        # planner prices links by bandwidth (a 100× slower NIC read 3.7× from P2P alone).
        # Only needed where it is used.
        score = np.where(is_comm, comm, comp)
        need = np.nonzero(is_comm & ~self._dp_only & ((ex_m > 0) | (self.state == RankState.SLOW)))[0]
        if len(need):
            ring = dp_ratio[need]
            bulk = np.where(np.isfinite(ring) & (ring > 1.0 + c.dp_threshold), ring, np.nan)
            score[need] = np.fmax(np.fmax(nanmedian(dirs[:, need], axis=0), bulk), path[need])
        suspect = (ex_c > 0) | (ex_m > 0)
        # a rank found link-slow recovers on its links — its P2P and its DP ring's bulk transfer,
        # which a shaper's burst cannot hide — and its compute need only be no fault of its own
        # (on shared cores a link-slow rank's compute ratio swings by ±20 %: three consecutive
        # iterations within recover_threshold took up to 250 iterations after the link was back)
        # Where its DP ring is measured, that bulk transfer is the hysteresis (a slow NIC keeps it
        # far above dp_threshold), and its P2P need only be no longer suspect: small P2P messages
        # on shared cores read above comm_threshold / 2 in one iteration of three when healthy.
        link_slow = (self.state == RankState.SLOW) & (self.cause_code > 0)
        ev = {"compute_ratio": comp, "link_ratio": link, "dp_ratio": dp_ratio,
              "p2p_in_ratio": np.fmax(in_f, in_b)}
        if adapt is None:
            window = self._recovery_window()
            comp_now, link_now, ring_now = window.push(comp, comm, dp_ratio, link_slow,
                                                       (self.state == RankState.HEALTHY) & suspect)
            ring = link_slow & np.isfinite(ring_now)
            ring_back = window.ring_back_below(c.dp_threshold)
            normal = (fill_nan(comp_now, 1.0) < 1 + np.where(link_slow, c.slow_threshold, c.recover_threshold)) & (
                fill_nan(link_now, 1.0) < 1 + np.where(ring, comm_thr, np.maximum(c.recover_threshold, comm_thr / 2))) & (
                ~ring | (ring_now < ring_back))
        else:
            normal = self._noise_normal(adapt[1], link_slow)
            ev["shift_spreads"] = np.where(is_comm, adapt[2][:, 1], adapt[2][:, 0])
        found = self._advance(t, suspect, normal, score, is_comm, ev, now, hold, adaptive=adapt is not None)
        if adapt is not None and x is not None:
            self._noise_learn(x)
        rw = pred.rewarming
        if t.iteration % c.calib_every == 0:
            healthy = (self.state == RankState.HEALTHY) & ~suspect
            if t.tp_wait is not None:  # a member's spans are as slow as its group's slowest
                healthy = group_all(healthy, ix)
            pred.calibrate(t, tok, ssq, healthy, warm=False, only=~pred.rewarm_keys() if rw else None)
        if rw:
            self._rewarm_learn(t, tok, ssq)
        return found

    def _recovery_window(self) -> RecoveryWindow:
        """This plan's window of recent evidence for the fixed-threshold recovery (a new one
        when the plan or recover_iters changed)."""
        w, n = 2 * self.config.recover_iters - 1, self.index.n
        if self._recovery is None or not self._recovery.fits(w, n):
            self._recovery = RecoveryWindow(w, n)
        return self._recovery

    def _common_factor(self, comp: FloatArray) -> float:
        """The median compute ratio of the ranks that may serve as peers (alive, not
        confirmed slow, with evidence), capped at 1 unless ``peer_common_slowdown``: a
        common speed-up is the model's error, not a device's; a common slowdown stays
        visible by default (every device may really be slow). 1 where fewer than three
        peers have evidence: a median of two is one of them."""
        peers = (self.state != RankState.DEAD) & (self.state != RankState.SLOW) & np.isfinite(comp)
        if int(peers.sum()) < 3:
            return 1.0
        common = median(comp[peers])
        return common if self.config.peer_common_slowdown else min(1.0, common)

    def _rewarm_learn(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray) -> None:
        if t.iteration >= self._rw_from:  # not the switch iteration, nor records of the old plan
            st = self.state
            # ranks taken back after their slow verdict lapsed (idle.py) may still be slow
            doubtful = np.isin(self.index.ranks, list(self._lapses)) if self._lapses else None
            self.predictor.rewarm_calibrate(t, tok, ssq, st != RankState.DEAD, st == RankState.SLOW,
                                            self.cause_code > 0, self.score, coupled=t.tp_wait is not None,
                                            doubtful=doubtful)

    def _judge_steps(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, now: float) -> list[Finding]:
        assert t.rank_step is not None
        c = self.config
        pred = self.predictor
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = t.rank_step / pred.rank_step(tok, ssq)
        rw = pred.rewarming
        hold = None
        if rw:
            hold = pred.rank_rewarm()[2]
            ratio = np.where(hold, np.nan, ratio)
        suspect = fill_nan(ratio, 0.0) > 1 + c.step_threshold
        normal = fill_nan(ratio, 1.0) < 1 + c.recover_threshold
        x = None
        if c.adaptive:
            ratio = ratio / self._peer_factor(ratio, "steps")
            x = np.stack([ratio, np.full_like(ratio, np.nan)], axis=1)
            ex, recent, _ = self._noise_test(x)
            suspect = ex[:, 0] > 0
            normal = self._noise_normal(recent, np.zeros(len(ratio), dtype=np.bool_))
        found = self._advance(t, suspect, normal, fill_nan(ratio, 1.0), None, {"step_ratio": ratio}, now, hold,
                              adaptive=x is not None)
        if x is not None:
            self._noise_learn(x)
        healthy = (self.state == RankState.HEALTHY) & ~suspect
        pred.calibrate(t, tok, ssq, healthy, warm=False, only=~pred.rewarm_keys() if rw else None)
        if rw:
            self._rewarm_learn(t, tok, ssq)
        return found

    def _judge_iteration(self, t: IterationTimings, tok: FloatArray, ssq: FloatArray, now: float) -> list[Finding]:
        c = self.config
        p = self.predictor.iteration_only(tok, ssq)
        ratio = t.time_s / p if p > 0 else 1.0
        self.last = {"predicted_iteration_s": p, "observed_iteration_s": t.time_s}
        job = self._job
        ev = {"iteration_ratio": ratio, "predicted_iteration_s": p, "observed_iteration_s": t.time_s}
        out: list[Finding] = []
        if ratio > 1 + c.iteration_threshold:
            job.run += 1
            job.ok = 0
            if not job.slow and job.run >= c.confirm_iters:
                job.slow, job.factor = True, ratio
                out.append(Finding(t.iteration, "fail-slow", (), None, None, None, ratio, "unknown",
                                   f"iterations took {ratio:.2f}x the time the cost model predicts for their batches "
                                   f"for {job.run} consecutive iterations ({t.time_s:.2f} s vs {p:.2f} s); the trace has "
                                   f"no per-rank timings, so the slow device cannot be localised", ev, now))
        else:
            job.run = 0
            if job.slow and ratio < 1 + c.recover_threshold * 2:
                job.ok += 1
                if job.ok >= c.recover_iters:
                    job.slow = False
                    out.append(Finding(t.iteration, "recovered", (), None, None, None, 1.0, "unknown",
                                       f"iteration time is back to the predicted cost ({ratio:.2f}x) for "
                                       f"{job.ok} iterations", ev, now))
            if not job.slow:
                self.predictor.calibrate(t, tok, ssq, self.state != RankState.DEAD, warm=False)
        return out

    # --- the state machine, vectorised over ranks --------------------------------------------
    def _advance(self, t: IterationTimings, suspect: npt.NDArray[np.bool_], normal: npt.NDArray[np.bool_],
                 score: FloatArray, is_comm: npt.NDArray[np.bool_] | None,
                 ev: dict[str, FloatArray], now: float, hold: npt.NDArray[np.bool_] | None = None,
                 adaptive: bool = False) -> list[Finding]:
        """``hold``: ranks whose evidence is re-warming; a slow one among them neither
        recovers nor updates its factor (a healthy or suspect one has suspect False).
        ``adaptive``: ``suspect`` comes from the shift test, which is its own persistence
        (one iteration cannot cross it): a suspect is confirmed at once."""
        c = self.config
        st = self.state
        live = st != RankState.DEAD
        watching = live & ((st == RankState.HEALTHY) | (st == RankState.SUSPECT))
        # persistence per cause: a compute blip and a later link blip are two unrelated
        # noises, not two iterations of one slowdown
        sus_c = suspect & ~is_comm if is_comm is not None else suspect
        sus_m = suspect & is_comm if is_comm is not None else np.zeros_like(suspect)
        self.run = np.where(watching & sus_c, self.run + 1, np.where(watching, 0, self.run))
        self.run_m = np.where(watching & sus_m, self.run_m + 1, np.where(watching, 0, self.run_m))
        st[watching & suspect & (st == RankState.HEALTHY)] = RankState.SUSPECT
        st[watching & ~suspect] = RankState.HEALTHY
        if adaptive:  # far out in this iteration alone: a suspect, not yet a finding
            far = self._far  # (n, 2): compute, communication; columns, not any(axis=1) (slow on short rows)
            st[watching & ~suspect & (far[:, 0] | far[:, 1])] = RankState.SUSPECT
        need = 1 if adaptive else c.confirm_iters
        confirm = watching & ((self.run >= need) | (self.run_m >= need))
        confirm &= ~self._tp_leak(confirm & ~sus_m, score)
        mates = np.zeros_like(confirm)
        ring_found = confirm & sus_m & self._dp_only & ~self._path_end
        if is_comm is not None and ring_found.any():
            mates = self._ring_mates(ring_found, watching & ~confirm & ~self._path_end)
            confirm |= mates
            nic = (confirm & sus_m | (st == RankState.SLOW) & (self.cause_code > 0)) & ~self._dp_only
            unexplained = rings_outside_slow_nics(ring_found | mates, nic, self.index)
            confirm &= ~unexplained
            mates &= ~unexplained
        slow = live & (st == RankState.SLOW)
        if hold is not None:
            slow &= ~hold
        self.ok_run = np.where(slow & normal, self.ok_run + 1, np.where(slow, 0, self.ok_run))
        recover = slow & (self.ok_run >= c.recover_iters)
        # a slow rank's factor follows its latest ratios
        self.score = np.where(slow & ~normal, 0.5 * self.score + 0.5 * score, self.score)
        out: list[Finding] = []
        if confirm.any():
            self._mark_slow(confirm, now, adaptive)
            self.score = np.where(confirm, score, self.score)
            if is_comm is not None:
                self.cause_code = np.where(confirm, is_comm.astype(np.int64), self.cause_code)
            for i in np.nonzero(confirm)[0].tolist():  # found on a path, or not (any more)
                (self._via_path.add if self._path_end[i] and self.cause_code[i] else self._via_path.discard)(
                    self.index.ranks[i])
            if mates.any():  # named for their ring's transfer: its cause and its ratio
                self.cause_code = np.where(mates, 1, self.cause_code)
                self.score = np.where(mates, fill_nan(ev["dp_ratio"], 1.0), self.score)
            out += self._group(t, np.nonzero(confirm)[0], "fail-slow", is_comm is None, ev, now)
            for i in np.nonzero(confirm)[0].tolist():
                self._drift.start(self.index.ranks[i], float(self.score[i]))
        if recover.any():
            st[recover] = RankState.HEALTHY
            if adaptive:
                self.noise.clear_windows(recover)
                self.floor_noise.clear_windows(recover)
            out += self._group(t, np.nonzero(recover)[0], "recovered", is_comm is None, ev, now)
            self._via_path.difference_update(self.index.ranks[i] for i in np.nonzero(recover)[0].tolist())
            for i in np.nonzero(recover)[0].tolist():  # evidence of recovery: a later verdict lapses on time
                self._lapses.pop(self.index.ranks[i], None)
            self.ok_run[recover] = 0
            self.run[recover] = 0
            self.run_m[recover] = 0
            self.score = np.where(recover, 1.0, self.score)
            for i in np.nonzero(recover)[0].tolist():
                self._drift.stop(self.index.ranks[i])
        out += self._drifted(t, slow & ~recover, score, is_comm, ev, now)
        if self._lapses:
            judged = watching & normal & ~suspect
            self.end_lapses_judged_normal(judged if hold is None else judged & ~hold)
        return out

    def _drifted(self, t: IterationTimings, slow: npt.NDArray[np.bool_], score: FloatArray,
                 is_comm: npt.NDArray[np.bool_] | None, ev: dict[str, FloatArray], now: float) -> list[Finding]:
        """Slow ranks (``slow``: not re-warming) whose slowdown moved far from the factor last
        reported (``drift.py``; by ``SPREADS`` of its key's healthy spread at least): reported
        again, with their factor now. An iteration whose evidence leans to the other cause (a
        compute-slow rank's links this time) says nothing of the factor and is not counted."""
        moved: dict[int, float] = {}
        rows = np.nonzero(slow)[0]
        if not len(rows):
            return []
        spread = self.noise.relative_spread()  # (n, 2): compute, communication
        for i in rows.tolist():
            if is_comm is not None and bool(is_comm[i]) != bool(self.cause_code[i]):
                continue
            got = self._drift.push(self.index.ranks[i], float(score[i]), float(spread[i, 1 if self.cause_code[i] else 0]))
            if got is not None:
                moved[i], self.score[i] = got
        if not moved:
            return []
        return self._group(t, np.asarray(sorted(moved), dtype=np.int64), "fail-slow", is_comm is None, ev, now,
                           moved_from=moved)

    def _tp_leak(self, confirm_c: npt.NDArray[np.bool_], score: FloatArray) -> npt.NDArray[np.bool_]:
        """Compute suspects (``confirm_c``) not to confirm beside a far slower TP partner — one
        slow in compute already (its factor), or confirmed with them (this iteration's score):
        ``evidence.shadowed_by_tp_partner``."""
        slow_c = (self.state == RankState.SLOW) & (self.cause_code == 0)
        factor = np.where(self.state == RankState.SLOW, self.score, score)
        return shadowed_by_tp_partner(confirm_c, slow_c | confirm_c, factor, self.index)

    def _mark_slow(self, rows: npt.NDArray[np.bool_], now: float, adaptive: bool) -> None:
        """``rows`` turn slow at ``now``: their shift tests drop what they queued (a slow
        rank's ratios teach no healthy baseline)."""
        self.state[rows] = RankState.SLOW
        if adaptive:
            self.noise.forget(rows)
            self.floor_noise.forget(rows)
        for i in np.nonzero(rows)[0]:
            self._slow_at[self.index.ranks[int(i)]] = now

    def _ring_mates(self, found: npt.NDArray[np.bool_], watched: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """The other watched members of the DP rings of ``found`` (ranks only their ring's
        transfer shows slow): one measurement for all of them, so which member's test crosses
        first is chance (a wider learned spread stays below it on the same value). Named
        whole, in one finding: not one member now and another later, or the slow one never."""
        ix = self.index
        return np.asarray(watched & self._dp_only & np.isin(ix.ring, ix.ring[found]), dtype=np.bool_)

    def _group(self, t: IterationTimings, idx: npt.NDArray[np.int64], kind: FindingKind, coarse: bool,
               ev: dict[str, FloatArray], now: float, moved_from: Mapping[int, float] | None = None) -> list[Finding]:
        """One finding per (replica, stage, cause) among the ranks that changed state.
        ``moved_from``: ranks still slow whose factor moved, each with the factor reported before."""
        ix = self.index
        buckets: dict[tuple[int, int, int, int], list[int]] = {}
        for i in idx.tolist():
            cc = int(self.cause_code[i])
            if cc and not coarse and self._dp_only[i] and ix.ranks[i] not in self._via_path:
                # only the DP ring saw it: every member looks alike, report the ring
                key = (-1, int(ix.stage[i]), cc, int(ix.tp_idx[i]))
            else:
                key = (int(ix.rep[i]), int(ix.stage[i]), cc, -1)
            buckets.setdefault(key, []).append(i)
        out = []
        for (rep_key, stage, cc, _), members in sorted(buckets.items()):
            ranks = tuple(sorted(ix.ranks[i] for i in members))
            rep_opt: int | None = rep_key if rep_key >= 0 else None
            rep = rep_key if rep_key >= 0 else int(ix.rep[members[0]])
            group = ix.plan.replicas[rep].stages[stage]
            cause = "unknown" if coarse else ("communication" if cc else "compute")
            factor = float(np.median(self.score[members]))
            evidence = {name: float(np.nanmedian(arr[members])) for name, arr in ev.items()
                        if np.isfinite(arr[members]).any()}
            self.predicted_iteration_s()
            evidence.update(self.last)
            evidence["observed_iteration_s"] = t.time_s
            evidence["suspect_iterations"] = float(np.max(np.maximum(self.run, self.run_m)[members]))
            names = ", ".join(map(str, ranks))
            group_opt: tuple[int, ...] | None = None if rep_opt is None else group
            if rep_opt is not None:
                who = f"rank{'s' if len(ranks) > 1 else ''} {names} (replica {rep}, stage {stage}, TP group {list(group)})"
            elif len(ranks) == int(np.count_nonzero(ix.ring == ix.ring[members[0]])):  # the whole ring
                who = f"the DP ring of stage {stage} (ranks {names}; its P2P stays inside nodes, so the slow member cannot be told apart)"
            else:  # narrowed to the node whose NIC is slow (paths.rings_outside_slow_nics)
                who = (f"rank{'s' if len(ranks) > 1 else ''} {names} (the DP ring of stage {stage}, on the node whose "
                       "NIC also slows its other ranks' cross-node transfers)")
            if kind == "recovered":
                reason = (f"{who} back to the predicted speed for {self.config.recover_iters} consecutive iterations "
                          f"(was {self._cause_text(cause)} {self._factor_text(members)})")
                f = Finding(t.iteration, kind, ranks, stage, rep_opt, group_opt, 1.0, cause, reason, evidence, now)
            else:
                what = self._evidence_text(cause, members)
                if moved_from is not None:
                    was = float(np.median([moved_from[i] for i in members]))
                    evidence["reported_factor"] = was
                    reason = (f"{who}, slow since an earlier finding: its slowdown moved from {was:.2f}x to "
                              f"{factor:.2f}x — {what} {factor:.2f}x the predicted time in the median of its latest "
                              f"{self.config.factor_drift_iters} judged iterations")
                else:
                    reason = (f"{who}: {what} {factor:.2f}x the time the calibrated cost model predicts for the "
                              f"batches it ran, for {int(evidence['suspect_iterations'])} consecutive iterations")
                if "predicted_iteration_s" in self.last:
                    reason += (f"; iteration {t.time_s:.2f} s vs {self.last['predicted_iteration_s']:.2f} s predicted "
                               f"with every device healthy")
                cost = self._impact(members, factor, cause, rep_opt is None, evidence.get("dp_ratio", 1.0))
                said, reason = self._priced(kind, cost, reason, evidence)
                f = Finding(t.iteration, said, ranks, stage, rep_opt, group_opt, factor, cause, reason, evidence, now)
            log.info("%s -> %s: %s", ranks, "SLOW" if kind == "fail-slow" else "HEALTHY", f.reason)
            out.append(f)
        return out

    def _evidence_text(self, cause: str, members: list[int]) -> str:
        """What the finding rests on, named: compute (with TP collective waits taken off), the
        P2P link, the DP ring's transfer (from its last member's arrival), or the step alone."""
        if cause == "compute":
            return "compute (F/B/W ops" + (", TP collective waits taken off)" if self._tp_evidence else ")") + " ran"
        if cause == "communication":
            if all(self._dp_only[i] and self.index.ranks[i] not in self._via_path for i in members):
                return "its DP ring's all-reduce (the transfer after the last member arrived) ran"
            return "its P2P link's transfers (in and out) ran"
        return "its step (no per-op timings) took" if self._level == "rank_step" else "its step took"

    def _cause_text(self, cause: str) -> str:
        return {"compute": "compute-slow", "communication": "link-slow"}.get(cause, "slow")

    def _factor_text(self, members: list[int]) -> str:
        return f"{float(np.max(self.score[members])):.2f}x"

    def predicted_iteration_s(self) -> float | None:
        """Predicted time of the latest judged iteration with every device healthy: the
        compiled schedule over predicted op and transfer times, then DP and optimizer, plus
        the share of an iteration the schedule leaves out (``seeds.PauseShare``, learned from
        the healthy iterations priced here before this one)."""
        if "predicted_iteration_s" not in self.last and self._pending is not None:
            simulated = self.predictor.iteration(*self._pending)[0]
            epoch, seeded = self._pending_pricing
            if epoch != self._pauses_epoch:  # the gap was learnt against other pricing
                self._pauses.reseed()
                self._pauses_epoch = epoch
            self.last["predicted_iteration_s"] = self._pauses.predict(simulated)
            observed = self.last.get("observed_iteration_s")
            # a seed-priced iteration would teach the gap the seed's error, not the pauses
            calm = not seeded and bool(np.all(self.state == RankState.HEALTHY)) and not np.any(
                np.maximum(self.run, self.run_m) > 0)
            if observed is not None and calm:
                self._pauses.learn(observed, simulated)
        return self.last.get("predicted_iteration_s")
