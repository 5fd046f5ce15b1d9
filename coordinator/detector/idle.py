"""The detector's verdicts on ranks the plan does not use (spares, excluded ranks).

Nothing the detector normally reads observes an idle rank, so its verdict is kept (a
still-slow device is not handed back to the next re-plan as healthy), judged afresh by the
rank's compute probes (``detector.probe``), ended by an operator (``readmit``), or, where no
probe can judge it, left to lapse after ``DetectorConfig.spare_verdict_s``. A verdict that
lapsed and was given again within ``spare_verdict_s`` of the lapse (the fault outlasted it:
the plan took the rank back and its timings found it slow) belongs to the same fault, and
holds as long as that fault has lasted so far (at least ``spare_verdict_s``, at most
``MAX_LAPSE_SCALE`` × it): fault durations are heavy-tailed, so one that has lasted longer
is expected to last longer still. Evidence that the rank recovered (its timings, its
probes, an operator) ends the fault.
``Detector`` inherits this; it is split out only to keep modules small. Pure.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.config import DetectorConfig
from resihp.coordinator.detector.evidence import PlanIndex
from resihp.coordinator.detector.probe import ProbeBook, check_probe, is_slow_probe, judge_probe
from resihp.coordinator.detector.verdicts import Finding, RankState

# the longest a verdict is held before it lapses, in spare_verdict_s: a congested link that
# lasts hours is taken back and found again at most every 8 × 600 s, not every 600 s (each
# time a re-plan onto it, some iterations at its speed, and a re-plan off it)
MAX_LAPSE_SCALE = 8


class IdleRankVerdicts:
    # the detector's state this part reads and writes (set by Detector.__init__)
    config: DetectorConfig
    index: PlanIndex
    _nodes: dict[int, str]
    _state: dict[int, RankState]
    _factor: dict[int, float]
    _cause: dict[int, str]
    _slow_at: dict[int, float]
    _lapsed: list[tuple[int, float]]
    _lapses: dict[int, tuple[float, float]]  # per rank: (its fault's first verdict, when its latest verdict lapsed)
    _lapse_ok: dict[int, int]  # per lapsed rank back in the plan: its judged-normal iterations in a row
    _now: float
    _last_iter: int
    _probes: ProbeBook
    state: npt.NDArray[np.int64]  # RankState of every rank of the plan, by PlanIndex position

    def observe_probe(self, rank: int, probe_s: float, now: float) -> list[Finding]:
        """An idle rank's compute probe (``detector.probe``): a fail-slow finding when a healthy
        idle rank's probes turn slow, a recovered one when a slow idle rank's turn normal; a
        slow probe renews the rank's verdict. A rank of the plan only refreshes the reference
        (its iterations judge it). Raises ValueError on an unknown rank or a bad duration."""
        check_probe(rank, probe_s, self._nodes)
        if rank in self.index.pos:
            # a rank of the plan (every rank's start-up probe, thousands at once): recorded for
            # the reference only, in O(1); its iterations judge it
            self._probes.record(rank, probe_s)
            return []
        self._set_clock(now)
        # no _sync_out: copying 16K ranks' states per probe was most of its cost
        state = self._state.get(rank, RankState.HEALTHY)
        got = self._probes.read(rank, probe_s, self._unreliable())
        if got.ratio is None or state == RankState.DEAD:
            self._probes.forget_runs(rank)
            return []
        if state == RankState.SLOW and self._cause.get(rank) == "communication":
            return []  # a compute probe says nothing of links: the lapse decides
        slow = is_slow_probe(got.ratio, self.config)
        run = self._probes.count(rank, slow)
        evidence = {"probe_s": got.probe_s, "reference_s": float(got.reference_s or 0.0), "ratio": got.ratio,
                    "probes": float(run)}
        action = judge_probe(state == RankState.SLOW, slow, run, self.config)
        if action == "renew":  # and its factor
            self._slow_at[rank], self._factor[rank] = self._now, got.ratio
        if action == "recovered":
            self._forget(rank)
            self._lapses.pop(rank, None)
            self._probes.forget_runs(rank)
            return [Finding(self._last_iter, "recovered", (rank,), None, None, None, 1.0, "compute",
                            f"idle rank {rank} recovered: its last {run} compute probes ran at x{got.ratio:.2f} of "
                            f"the other ranks' (threshold x{1 + self.config.probe_threshold:.2f})", evidence, now)]
        if action != "fail-slow":
            return []
        self._state[rank], self._factor[rank], self._cause[rank] = RankState.SLOW, got.ratio, "compute"
        self._slow_at[rank] = self._now
        self._probes.forget_runs(rank)
        return [Finding(self._last_iter, "fail-slow", (rank,), None, None, None, got.ratio, "compute",
                        f"idle rank {rank} is compute-slow: its last {run} compute probes ran at x{got.ratio:.2f} of "
                        f"the other ranks' (threshold x{1 + self.config.probe_threshold:.2f})", evidence, now)]

    def probe_ratios(self) -> dict[int, float]:
        """Every probed rank's latest probe over the median latest probe of the ranks not
        judged slow or dead (for operators: ``resihp admin status``); one median for all."""
        return self._probes.ratios(self._unreliable())

    def _unreliable(self) -> set[int]:
        """Ranks judged slow or dead, whose probes do not say what healthy is. An idle rank's
        state lives in the dicts, a rank of the plan's in the arrays."""
        bad = {self.index.ranks[i] for i in np.flatnonzero(self.state >= int(RankState.SLOW))}
        bad.update(r for r in self._idle() if self._state.get(r, RankState.HEALTHY) >= RankState.SLOW)
        return bad

    def _left_slow(self) -> dict[int, tuple[float, bool]]:
        """Ranks confirmed slow that the plan no longer uses (spares, excluded): factor and
        whether the cause was communication. Nothing observes them any more, so their last
        verdict stands — forgetting it would hand a still slow device back to the next re-plan
        as a healthy one — until an operator readmits the rank (``readmit``) or it lapses
        (``_set_clock``)."""
        state = self._state
        return {r: (max(1.0, self._factor.get(r, 1.0)), self._cause.get(r) == "communication")
                for r in self._idle() if state.get(r) == RankState.SLOW}

    def _idle(self) -> set[int]:
        """The job's ranks the plan does not use (a set difference: cheap at 16K ranks)."""
        return self._nodes.keys() - self.index.pos.keys()

    def _set_clock(self, now: float) -> None:
        """Move the detector's clock: a left-out rank's verdict lapses ``spare_verdict_s``
        after it was given (a fail-slow's expected duration), queued for ``tick`` to report
        as a recovery; a plan that uses the rank again lets its own timings judge it."""
        self._now = max(self._now, now)
        if not self._slow_at:  # no verdict to lapse (and the idle set costs 0.4 ms at 4096 ranks)
            return
        for r in self._left_slow():
            age = self._now - self._slow_at.get(r, self._now)
            if age >= self.verdict_hold_s(r):
                self._lapses[r] = (self._fault_onset(r), self._now)
                self._lapse_ok.pop(r, None)
                self._forget(r)
                self._lapsed.append((r, age))

    def _fault_onset(self, rank: int) -> float:
        """The first verdict of the fault ``rank``'s current verdict belongs to: an earlier one
        that lapsed within spare_verdict_s before this verdict was given, else this one."""
        given = self._slow_at.get(rank, self._now)
        onset, lapsed_at = self._lapses.get(rank, (given, -float("inf")))
        return onset if given - lapsed_at <= self.config.spare_verdict_s else given

    def verdict_hold_s(self, rank: int) -> float:
        """How long ``rank``'s slow verdict holds while the plan leaves it idle: as long as its
        fault has lasted when the verdict was given, within [1, MAX_LAPSE_SCALE] ×
        spare_verdict_s (module docstring)."""
        spare = self.config.spare_verdict_s
        lasted = self._slow_at.get(rank, self._now) - self._fault_onset(rank)
        return min(MAX_LAPSE_SCALE * spare, max(spare, lasted))

    def _lapse_finding(self, rank: int, age: float, now: float) -> Finding:
        onset, lapsed_at = self._lapses.get(rank, (0.0, 0.0))
        held = ("" if onset >= lapsed_at - age - 1e-6 else  # this verdict was its fault's first
                " (held as long as its fault had lasted: an earlier verdict lapsed while the fault went on)")
        return Finding(self._last_iter, "recovered", (rank,), None, None, None, 1.0, "unknown",
                       f"rank {rank} is treated as recovered: its slow verdict lapsed {age:.0f} s after it was given "
                       f"(spare_verdict_s {self.config.spare_verdict_s:g} s){held} while the plan left the rank idle and "
                       "no compute probe renewed it; a plan that uses it again lets its timings judge it",
                       {"verdict_age_s": age}, now)

    def end_lapses_judged_normal(self, normal: npt.NDArray[np.bool_]) -> None:
        """``normal``: per rank of the plan, judged normal this iteration (its evidence not
        re-warming). A rank taken back after its verdict lapsed that is judged normal for
        ``recover_iters`` iterations in a row has recovered: its lapse record ends (it no
        longer lengthens a later verdict's hold, and it teaches re-warming keys again)."""
        for r in list(self._lapses):
            i = self.index.pos.get(r)
            if i is None:
                continue
            run = self._lapse_ok.get(r, 0) + 1 if normal[i] else 0
            if run >= self.config.recover_iters:
                self._lapses.pop(r, None)
                self._lapse_ok.pop(r, None)
            else:
                self._lapse_ok[r] = run

    def _forget(self, rank: int) -> None:
        self._state[rank] = RankState.HEALTHY
        self._factor[rank] = 1.0
        self._cause.pop(rank, None)
        self._slow_at.pop(rank, None)

    def readmit(self, rank: int) -> bool:
        """Forget the slow verdict of a rank outside the plan (an operator's readmission: the
        device was repaired or the fault is over); True if there was one. A rank in the plan
        recovers through its own timings (the ``recovered`` finding) instead."""
        if rank not in self._left_slow():
            return False
        self._forget(rank)
        self._lapses.pop(rank, None)
        return True

