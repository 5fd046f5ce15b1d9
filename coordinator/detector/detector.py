"""Fail-slow and fail-stop detection, workload-aware.

Fail-slow: every iteration, each rank's *observed* op times are divided by what the
calibrated cost model predicts for the very micro-batches it ran (``detector_model``), so a
batch of long packed sequences, which costs more because attention grows with Σl², raises
the prediction with the observation and stays at ratio ~1. Per rank the detector takes
Σ observed / Σ predicted over its compute ops after taking off the one op furthest above
the rank's own ratio (so one GC pause or OS hiccup does not make a rank slow) and, for
links, the smallest of those ratios over the four directions of its cross-node P2P
transfers (in and out, forward and backward): only a rank whose own link is slow is slow
in all of them, its neighbours only in those that touch it. Where a trace has no chunk
timings it falls back to per-rank step times (``rank_step_s``: rank-level, cause unknown)
and then to the iteration time alone (job-level).

Each rank moves through healthy → suspect → slow → (recovered →) healthy (an explicit
state machine: its transition table in ``verdicts``, run over all ranks at once in
``judge``): a ratio above the threshold makes a rank a suspect, ``confirm_iters``
consecutive suspect iterations confirm it (persistence: a single noisy iteration is never a
finding), ``recover_iters`` consecutive normal iterations recover it. Fail-stop: an exit event confirms at once; a rank whose heartbeats stop for
``heartbeat_timeout_s`` is declared dead at the next ``tick(now)``.

After a plan change (``set_plan``) a layout's op times need not scale as the cost model's
features say (kernel shapes, overlap, contention on shared CPUs). A rank whose work changed
(``rank_work``: layer range, TP size or group, stage, pipeline depth, micro-batch share,
schedule; or it was a spare) gets fresh cost keys, and they, like any uncalibrated key of
the new plan (a new DP degree), re-warm: they learn from every sample of ``rewarm_iters``
iterations after the switch iteration and are then fitted on all of them; evidence using a
re-warming key (a rank's compute, or its P2P / DP ring) cannot make it a suspect. Unchanged
ranks keep their calibration (a device turning slow where it was is caught at once), and
fail-stop detection never pauses. States carry over. A confirmed-slow rank that moved stays
slow, factor frozen, through its window; its new keys learn from healthy TP partners, or
without one from its own times divided by its factor, so afterwards it stays slow if still
slow, or recovers after ``recover_iters`` normal iterations. A moved suspect is cleared.

Pure: numpy only, deterministic, time comes in as ``now``.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.adaptive import peer_groups
from resihp.coordinator.detector.config import DetectorConfig as DetectorConfig  # re-exported: its home for callers
from resihp.coordinator.detector.drift import FactorDrift
from resihp.coordinator.detector.evidence import (
    IterationTimings,
    PlanIndex,
    batch_features,
    rank_work,
    split_dp_wait,
    timings_from_record,
)
from resihp.coordinator.detector.hangs import hang_culprits, stuck_culprits, stuck_reason
from resihp.coordinator.detector.idle import IdleRankVerdicts
from resihp.coordinator.detector.inflight import InFlight
from resihp.coordinator.detector.judge import IterationJudge, JobTrack
from resihp.coordinator.detector.noise import NoiseModel
from resihp.coordinator.detector.paths import QuietPaths
from resihp.coordinator.detector.predictor import Predictor
from resihp.coordinator.detector.probe import ProbeBook
from resihp.coordinator.detector.seeds import KeyShapes, PauseShare
from resihp.coordinator.detector.verdicts import TRANSITIONS as TRANSITIONS  # re-exported: callers import them here
from resihp.coordinator.detector.verdicts import Finding as Finding
from resihp.coordinator.detector.verdicts import FindingKind as FindingKind
from resihp.coordinator.detector.verdicts import RankState as RankState
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import (
    ExitEvent,
    HeartbeatEvent,
    IterationRecord,
    OpState,
    PlanChange,
    Record,
    TraceHeader,
    describe_exit,
)

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


# iterations a finding's cost is averaged over: a slowdown costs more on some batches than on
# others (which replica is the longest changes with the batch), and a few batches can miss
# the long-run cost by half
COST_WINDOW = 32


class Detector(IterationJudge, IdleRankVerdicts):
    def __init__(self, header: TraceHeader, config: DetectorConfig | None = None) -> None:
        self.header = header
        self.config = config or DetectorConfig()
        self._nodes = {d.rank: d.node for d in header.devices}
        self.index = PlanIndex(header.plan, self._nodes)
        c = self.config
        self.predictor = Predictor(self.index, window=c.calib_window, refit_every=c.refit_every,
                                   samples_per_key=c.calib_samples_per_key)
        self._shapes = KeyShapes(header.model)
        self._pauses = PauseShare()
        self._commons = {}  # adaptive.py: the latest common factors, per compute estimator
        self._via_path: set[int] = set()  # judge.py: ranks found slow on a path inside their node
        self._state: dict[int, RankState] = {}
        self._factor: dict[int, float] = {}
        self._cause: dict[int, str] = {}
        self._slow_at: dict[int, float] = {}  # when each rank's slow verdict was given (injected time)
        self._lapsed: list[tuple[int, float]] = []  # spares whose verdict lapsed, not yet reported (rank, age)
        self._lapses: dict[int, tuple[float, float]] = {}  # idle.py: per rank, its fault's onset and latest lapse
        self._lapse_ok: dict[int, int] = {}  # idle.py: per lapsed rank back in the plan, its normal iterations in a row
        self._now = 0.0  # the latest time the detector was told of
        self._seen = 0  # iterations observed with the current evidence level
        self._level = ""
        self._last_beat: dict[int, float] = {}
        # rank -> the op its latest beat named, that beat's time, the first beat's that named it
        self._ops: dict[int, tuple[OpState, float, float]] = {}
        self._beats_on = False
        self._inflight = InFlight(self.index.ranks, c.in_flight_min_iteration_s)
        self._drift = FactorDrift(c.factor_drift, c.factor_drift_iters)
        self._probes = ProbeBook()  # idle ranks' compute probes (coordinator/detector/probe.py)
        self._job = JobTrack()  # iteration-level (job-wide) evidence
        self._last_iter = -1
        self._pending: tuple[FloatArray, FloatArray] | None = None
        self._recent: deque[tuple[FloatArray, FloatArray, float]] = deque(maxlen=COST_WINDOW)
        self._progress_at: float | None = None  # when the latest iteration was observed
        self._iter_times: deque[float] = deque(maxlen=16)  # the latest iterations' times
        self._hang_after: float | None = None  # hang_after_s() of those (None: to work out)
        self.last: dict[str, float] = {}  # the latest iteration's predictions (for tools and benchmarks)
        # re-warming: each rank's work and calibration tag, the plan generation, the first
        # iteration re-warming keys learn from, the job-level key's learning iterations left
        self._work = rank_work(header.plan)
        self._tags: dict[int, tuple[int, int]] = {}
        self._gen = 0
        self._rw_from = 0
        self._job_left = 0
        self.noise, self.floor_noise = (
            NoiseModel(self.index.ranks, kinds, window=c.noise_window, level=c.noise_level, clip=c.noise_clip,
                       floor=c.effect_floor, prior_spread=c.prior_spread, min_spread=c.min_spread,
                       min_samples=c.noise_min_samples) for kinds in (2, 1))
        self._alloc()

    # --- plan -----------------------------------------------------------------------------
    def _alloc(self) -> None:
        n = self.index.n
        ranks = self.index.ranks
        self.state = np.array([int(self._state.get(r, RankState.HEALTHY)) for r in ranks], dtype=np.int64)
        self.run = np.zeros(n, dtype=np.int64)
        self.run_m = np.zeros(n, dtype=np.int64)
        self.ok_run = np.zeros(n, dtype=np.int64)
        self.score = np.array([self._factor.get(r, 1.0) for r in ranks])
        self._dp_only = np.zeros(n, dtype=bool)
        self._path_end = np.zeros(n, dtype=bool)
        self._quiet_paths = QuietPaths(self.index, self.config.comm_threshold)  # a new plan's ranks have other paths
        self._severe_prev = np.zeros(n, dtype=bool)
        self._peers = peer_groups(self.index.ckey)  # adaptive.py: ranks doing the same work anchor each other
        self._recovery = None  # a new plan's ranks sit at other positions
        self.cause_code = np.array([1 if self._cause.get(r) == "communication" else 0 for r in ranks], dtype=np.int64)
        self._beat_at = self._beat_array()

    def _beat_array(self) -> FloatArray:
        """Each position's latest heartbeat (NaN: none yet, or heartbeats not on), from the
        per-rank record that outlives plan changes."""
        return np.array([self._last_beat.get(r, np.nan) for r in self.index.ranks], dtype=np.float64)

    def _sync_out(self) -> None:
        for i, r in enumerate(self.index.ranks):
            self._state[r] = RankState(int(self.state[i]))
            self._factor[r] = float(self.score[i])
            self._cause[r] = "communication" if int(self.cause_code[i]) else "compute"

    def set_plan(self, plan: Plan, iteration: int | None = None) -> None:
        """Adopt a new layout whose first iteration is ``iteration`` (default: the next);
        ranks whose work changed re-warm (module docstring). Adopting the current plan again
        changes nothing (the coordinator's engine gets set_plan, then the PlanChange record)."""
        self._sync_out()
        work = rank_work(plan)
        changed = sorted(r for r, w in work.items() if self._work.get(r) != w)
        self._tags = {r: t for r, t in self._tags.items() if r in work}
        if changed:
            self._gen += 1
            for r in changed:
                self._tags[r] = (self._gen, work[r][4])  # + micro-batch share: replicas with other shares do not pool
            self.predictor.iter_key = ("iter", self._gen)
            self._job_left = self.config.rewarm_iters
        self._work = work
        self.index = PlanIndex(plan, self._nodes, self._tags)
        self.predictor.reindex(self.index)
        for model in (self.noise, self.floor_noise):
            model.remap(self.index.ranks, set(changed))
        self._recent.clear()  # shaped by the old plan
        if changed or iteration is not None:
            # the switch iteration itself (state transfer, new communicators, cold caches)
            # is judged by nobody and teaches nothing
            first = self._last_iter + 1 if iteration is None else iteration
            self._rw_from = max(self._rw_from, first + 1) if not changed else first + 1
        if changed:
            self.predictor.start_rewarm(self.config.rewarm_iters)
            self.predictor.seed_rewarm(self._shapes)  # priced from the earlier fits meanwhile
        self._alloc()
        self._job = JobTrack()
        if changed:  # other iterations, other ops per iteration
            self._inflight.reset(self.index.ranks)
            self._drift.new_plan()

    # --- inputs ---------------------------------------------------------------------------
    def observe(self, record: Record, now: float) -> list[Finding]:
        if isinstance(record, IterationRecord):
            return self.observe_timings(timings_from_record(record, self.index), now)
        if isinstance(record, HeartbeatEvent):
            self._beat(record.rank, record.time_s, record.op)
            return self.tick(now)
        if isinstance(record, ExitEvent):
            return self._exit(record, now)
        if isinstance(record, PlanChange):
            self.set_plan(record.plan, record.iteration)
            return []
        raise TypeError(f"Detector.observe: not a trace record: {record!r}")

    def _progress(self, time_s: float, now: float) -> None:
        """An iteration ended at ``now``: the job makes progress."""
        self._progress_at = now
        if np.isfinite(time_s) and time_s > 0:
            self._iter_times.append(float(time_s))
            self._hang_after = None
        self._inflight.progress(now, time_s)

    def _beat(self, rank: int, t: float, op: OpState | None = None) -> None:
        if op is not None:
            was = self._ops.get(rank)
            self._ops[rank] = (op, t, was[2] if was is not None and was[0] == op else t)
            self._inflight.beat(rank, t, op)
        if not self._beats_on:  # heartbeats are on for this job: every rank starts its clock now
            self._beats_on = True
            for r in self.index.ranks:
                self._last_beat.setdefault(r, t)
            self._beat_at = self._beat_array()
        self._last_beat[rank] = max(t, self._last_beat.get(rank, t))
        i = self.index.pos.get(rank)
        if i is not None:
            self._beat_at[i] = self._last_beat[rank]

    def observe_op(self, rank: int, t: float, op: OpState) -> None:
        """The op a rank's heartbeat names, for in-flight judging only (``tick`` judges): O(1).
        The coordinator keeps liveness on its own clock and feeds no heartbeat events (a
        per-beat timeout scan over every rank would dominate it at a thousand ranks)."""
        self._inflight.beat(rank, t, op)

    def tick(self, now: float) -> list[Finding]:
        """Heartbeat timeouts as of ``now``, and spares whose slow verdict lapsed (``_left_slow``)
        as ``recovered`` findings: the coordinator re-plans on them as on any recovery."""
        self._set_clock(now)
        out = [self._lapse_finding(r, age, now) for r, age in self._lapsed]
        self._lapsed = []
        if self.config.in_flight:
            out += self._in_flight(now)
        if not self._beats_on:
            return out
        out += self._no_progress(now)
        timeout = self.config.heartbeat_timeout_s
        # one vectorised test per tick: a tick per heartbeat (a trace replay) scanned every rank
        # in Python, 10 ms per beat at 256 ranks with the in-flight check below
        late = (now - self._beat_at > timeout) & (self.state != int(RankState.DEAD))  # never beaten: NaN, not late
        for i in np.flatnonzero(late).tolist():
            r = self.index.ranks[i]
            last = self._last_beat[r]
            self.state[i] = RankState.DEAD
            out.append(self._stop_finding(r, "heartbeat", now,
                                          f"no heartbeat from rank {r} for {now - last:.1f} s (timeout {timeout:g} s)",
                                          {"silence_s": now - last, "timeout_s": timeout}))
        return out

    def hang_after_s(self) -> float:
        """How long without an iteration is a hang: ``hang_iters`` times the usual iteration
        (the median of the latest observed ones), at least ``hang_floor_s``; infinite before
        the first iteration (a job still starting up is not hung)."""
        if not self._iter_times:
            return float("inf")
        if self._hang_after is None:  # asked on every tick, changed by an iteration
            self._hang_after = max(self.config.hang_iters * float(np.median(self._iter_times)), self.config.hang_floor_s)
        return self._hang_after

    def _no_progress(self, now: float) -> list[Finding]:
        """A job with no iteration for ``hang_after_s`` is stuck. In a synchronous job every
        rank stops reporting at once, so the rank that holds it up is the one whose heartbeats
        stopped while its peers' go on: heartbeats come from a thread beside the training
        loop, so a rank stuck in a collective keeps beating, a stopped process (SIGSTOP) or a
        frozen host does not. It is declared fail-stop, cause no-progress. When every rank
        beats on (a stuck kernel or collective with no silent rank) nothing is named here."""
        if self._progress_at is None:
            return []
        stalled = now - self._progress_at
        wait = self.hang_after_s()
        if stalled <= wait:
            return []
        quiet = {r: now - self._last_beat[r] for i, r in enumerate(self.index.ranks)
                 if self.state[i] != RankState.DEAD and r in self._last_beat}
        usual = float(np.median(list(quiet.values()))) if quiet else 0.0
        out = []
        op_held = {r: self._ops[r][1] - self._ops[r][2] for r in quiet if r in self._ops}
        held = hang_culprits(stalled, wait, quiet, op_held)
        if not held:
            return self._stuck(now, stalled, wait, quiet, op_held)
        for r in held:
            i = self.index.pos[r]
            self.state[i] = RankState.DEAD
            out.append(self._stop_finding(
                r, "no-progress", now,
                f"no iteration for {stalled:.1f} s ({self.config.hang_iters:g} iterations of {wait / self.config.hang_iters:.2f} s"
                f" or {self.config.hang_floor_s:g} s); rank {r}'s heartbeats stopped {quiet[r]:.1f} s ago while its "
                f"peers' go on (last {usual:.1f} s ago): a stopped process or frozen host holds the job up",
                {"stalled_s": stalled, "silence_s": quiet[r], "peers_silence_s": usual, "hang_after_s": wait}))
        return out

    def _in_flight(self, now: float) -> list[Finding]:
        """A compute slowdown found within the iteration it slows (``inflight.py``): the rank
        turns slow at once, as a confirmed finding of its records would make it, and the
        finding carries its cost like every other."""
        v = self._inflight.judge(now, _SlowOrDead(self))  # asked of one rank at most, not built per tick
        if v is None:
            return []
        i = self.index.pos[v.rank]
        rows = np.zeros(self.index.n, dtype=np.bool_)
        rows[i] = True
        self._mark_slow(rows, now, self.config.adaptive)
        self.score[i], self.cause_code[i] = v.factor, 0
        self._drift.start(v.rank, v.factor)
        self.run[i] = self.run_m[i] = self.ok_run[i] = 0
        stage, replica, group, _ = self._where(v.rank)
        ev = v.evidence()
        reason = f"rank {v.rank} (replica {replica}, stage {stage}, TP group {list(group or ())}): {v.describe()}"
        kind, reason = self._priced("fail-slow", self._impact([i], v.factor, "compute", False), reason, ev)
        log.info("%d -> SLOW: %s", v.rank, reason)
        return [Finding(self._last_iter + 1, kind, (v.rank,), stage, replica, group, v.factor, "compute", reason, ev, now)]

    def _stuck(self, now: float, stalled: float, wait: float, live: Mapping[int, float],
               held: Mapping[int, float]) -> list[Finding]:
        """No silent rank: name the ranks that wait for nobody while their peers wait in a
        p2p or collective op (``stuck_culprits``, from the ops the heartbeats name)."""
        ops = {r: self._ops[r][0] if r in self._ops else None for r in live}
        ages = {r: now - self._ops[r][1] for r in live if r in self._ops}
        out = []
        for r in stuck_culprits(stalled, wait, ops, ages, held):
            self.state[self.index.pos[r]] = RankState.DEAD
            waiting = sum(1 for o in ops.values() if o is not None and o.waiting)
            out.append(self._stop_finding(r, "no-progress", now, stuck_reason(r, ops, stalled, wait),
                                          {"stalled_s": stalled, "hang_after_s": wait, "waiting_ranks": float(waiting)}))
        return out

    def _exit(self, ev: ExitEvent, now: float) -> list[Finding]:
        self._set_clock(now)
        i = self.index.pos.get(ev.rank)
        if i is not None:
            if self.state[i] == RankState.DEAD:
                return []
            self.state[i] = RankState.DEAD
        elif self._state.get(ev.rank) == RankState.DEAD:
            return []
        self._state[ev.rank] = RankState.DEAD
        how = describe_exit(ev.code)
        return [self._stop_finding(ev.rank, "process-exit", now, f"the process of rank {ev.rank} {how} at t={ev.time_s:.3f} s",
                                   {"exit_code": float(ev.code), "exit_time_s": ev.time_s})]

    def _stop_finding(self, rank: int, cause: str, now: float, what: str, ev: dict[str, float]) -> Finding:
        where = self._where(rank)
        it = self._last_iter
        log.info("rank %d -> DEAD (%s)", rank, cause)
        return Finding(it, "fail-stop", (rank,), where[0], where[1], where[2], 1.0, cause,
                       f"{what}; {where[3]}", ev, now)

    def _where(self, rank: int) -> tuple[int | None, int | None, tuple[int, ...] | None, str]:
        plan = self.index.plan
        node = self._nodes.get(rank, "?")
        if not plan.has_rank(rank):
            return None, None, None, f"rank {rank} (node {node}) holds no model shard in the current plan"
        p = plan.position(rank)
        group = plan.replicas[p.replica].stages[p.stage]
        return p.stage, p.replica, group, (
            f"rank {rank} is on node {node}, replica {p.replica}, stage {p.stage}, TP group {list(group)}"
        )

    # --- one iteration --------------------------------------------------------------------
    def observe_timings(self, t: IterationTimings, now: float) -> list[Finding]:
        """The detector's per-iteration work on dense arrays (what ``observe`` converts to)."""
        self._last_iter = t.iteration
        self._set_clock(now)
        self._progress(t.time_s, now)
        ix, pred = self.index, self.predictor
        split_dp_wait(t, ix)  # the DP ring is judged by its transfer, not by a late replica's wait
        tok, ssq = batch_features(t.seqlens, ix.M)
        level = "chunks" if t.compute is not None else "rank_step" if t.rank_step is not None else "iteration"
        if level != self._level:
            self._level, self._seen = level, 0
        self._seen += 1
        alive = self.state != RankState.DEAD
        learn_rw = t.iteration >= self._rw_from
        if level == "iteration" and self._job_left > 0:  # the job-level key re-warms as a whole
            if learn_rw:
                pred.calibrate(t, tok, ssq, alive, warm=True)
                self._job_left -= 1
            return []
        if self._seen <= self.config.warmup_iters or not pred.ready(level):
            rw = pred.rewarming
            got = pred.calibrate(t, tok, ssq, alive, warm=True, only=None if learn_rw or not rw else ~pred.rewarm_keys())
            if rw and learn_rw:
                pred.tick_rewarm(got)
            if self._seen == self.config.warmup_iters:
                pred.refit_all()  # the models so far saw only the first iterations
            return []
        if level == "chunks":
            found = self._judge_chunks(t, tok, ssq, now)
            if self.config.pause_every and t.iteration % self.config.pause_every == 0:
                self.predicted_iteration_s()  # the gap the schedule leaves out keeps learning (judge.py)
            return found
        if level == "rank_step":
            return self._judge_steps(t, tok, ssq, now)
        return self._judge_iteration(t, tok, ssq, now)

    # --- queries --------------------------------------------------------------------------
    def suspects(self) -> dict[int, str]:
        """Current state of every rank of the plan (and of dead or slow ranks outside it)."""
        self._sync_out()
        names = {RankState.HEALTHY: "healthy", RankState.SUSPECT: "suspect", RankState.SLOW: "slow", RankState.DEAD: "dead"}
        return {r: names[s] for r, s in sorted(self._state.items())}

    def all_healthy(self) -> bool:
        """Every rank of the current plan is judged healthy (none suspect, slow or dead)."""
        return bool((self.state == RankState.HEALTHY).all())

    def rank_speed(self) -> dict[int, float]:
        """1.0 healthy, 1/factor for a slow rank (0.5 = 2x slow), 0.0 dead; ranks outside the
        plan keep their last verdict (``_left_slow``)."""
        out = {}
        for i, r in enumerate(self.index.ranks):
            s = self.state[i]
            out[r] = 0.0 if s == RankState.DEAD else (1.0 / max(1.0, float(self.score[i])) if s == RankState.SLOW else 1.0)
        for r, s in self._state.items():
            if r not in out and s == RankState.DEAD:
                out[r] = 0.0
        for r, (factor, _) in self._left_slow().items():
            out[r] = 1.0 / factor
        return out

    def compute_speed(self) -> dict[int, float]:
        """Like ``rank_speed`` but for compute only: a rank that is slow because of its
        links (cause "communication") keeps compute speed 1.0; see ``link_factor``."""
        speed = self.rank_speed()
        for i, r in enumerate(self.index.ranks):
            if self.state[i] == RankState.SLOW and int(self.cause_code[i]):
                speed[r] = 1.0
        for r, (_, comm) in self._left_slow().items():
            if comm:
                speed[r] = 1.0
        return speed

    def link_factor(self) -> dict[int, float]:
        """Link slowdown factor (>= 1) of every rank confirmed slow because of communication."""
        out = {r: max(1.0, float(self.score[i])) for i, r in enumerate(self.index.ranks)
               if self.state[i] == RankState.SLOW and int(self.cause_code[i])}
        out.update({r: factor for r, (factor, comm) in self._left_slow().items() if comm})
        return out


class _SlowOrDead:
    """``rank in this``: whether the detector has ``rank`` slow or dead (what the in-flight
    judgement leaves out), asked of one rank instead of a set built on every tick."""

    def __init__(self, det: Detector) -> None:
        self._det = det

    def __contains__(self, rank: object) -> bool:
        i = self._det.index.pos.get(rank) if isinstance(rank, int) else None
        return i is not None and int(self._det.state[i]) in (RankState.SLOW, RankState.DEAD)
