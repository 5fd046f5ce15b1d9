"""resihp: the real detector and the real planner, driven by the simulated faults.

Nothing of resihp's logic lives here; this adapter only does what the coordinator does in
a real run:

- **Detection.** Delays come from running ``resihp.coordinator.detector.detector`` on realistic
  simulated timings (sim/detection.py): a process exit is confirmed when it arrives, a
  silent node after the heartbeat timeout, a fail-slow after the iterations the detector
  needs on the slowed job (times the job's slowed iteration time), a recovery likewise.
  Until then resihp does not know. A fail-slow the detector misses is never acted on.
- **Knowledge.** As the coordinator does with ``Detector.compute_speed()`` and
  ``Detector.link_factor()``: a confirmed compute fail-slow gives its ranks compute speed
  1/estimated factor; a communication fail-slow gives a link-slow node's devices that link
  slowdown factor (their compute stays 1.0); a fail-stop marks them failed; a recovery or a
  repair clears them. A recovery is seen by the iterations of ranks the plan uses; ranks it
  left idle are judged by their compute probes (``coordinator/detector/probe.py``), one every
  ``probe_every_s`` (the hooks' default, 30 s), with the detector's rules: a probe above
  ``1 + probe_threshold`` renews the verdict, ``recover_iters`` probes in a row at or below
  it are a recovery; a compute fail-slow that starts on idle ranks is found by
  ``confirm_iters`` slow probes. A link-slow verdict, which no compute probe can judge,
  lapses ``DetectorConfig.spare_verdict_s`` after it was given, into a recovery (the
  detector's ``tick``), or — found again within ``spare_verdict_s`` of an earlier lapse —
  after as long as the fault had lasted (up to ``MAX_LAPSE_SCALE`` ×, as the detector); if the fault is still on and the new plan uses the ranks, the
  detector finds them again.
- **Decision.** ``resihp.coordinator.planner.planner.decide(cluster, model, batch, current,
  finding, now, config)`` on that view. If it acts, the job pauses for the decision's
  ``move_s`` (state moved / link bandwidth) plus the regroup latency, then runs the new
  plan. Throughput is always the simulator's own truth for that plan on the true world,
  so a plan built on a wrong estimate pays for it.
- A fail-stop stalls the job from the failure to the new plan (collectives hang) and loses
  the iteration in flight; no checkpoint rollback (state is rebuilt from DP replicas).
  If the planner finds no feasible plan the job waits for repairs.

Source: the ResiHP paper (arXiv:2605.06374) and this repository's coordinator.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

from resihp.coordinator.detector.config import DetectorConfig
from resihp.coordinator.detector.detector import Finding
from resihp.coordinator.detector.idle import MAX_LAPSE_SCALE
from resihp.coordinator.detector.probe import ProbeBook, is_slow_probe, judge_probe
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.planner.decision import earlier_layouts
from resihp.sim import detection
from resihp.sim.detection import DetectionOracle
from resihp.sim.engine import Phase, Reaction
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Policy, Settings, node_ranks
from resihp.sim.world import FailSlow, FailStop, WorldEvent

PROBE_EVERY_S = 30.0  # trainer_hooks: an idle rank's probe interval (init's probe_every_s)
_DECISIONS: dict[tuple[object, ...], Any] = {}
_CLUSTERS: dict[tuple[object, ...], tuple[JobSpec, Any]] = {}


def oracle_for(job: JobSpec) -> DetectionOracle:
    """One detection oracle per (model, tp, tokens): its measurements are reused by every run."""
    return detection.oracle_for(job.model, job.tp, job.tokens_per_microbatch)


class ResiHP(Policy):
    name = "resihp"
    source = "ResiHP (arXiv:2605.06374); real resihp.coordinator.detector.detector + resihp.coordinator.planner.planner"

    def __init__(self, job: JobSpec, perf: PerfModel, settings: Settings | None = None,
                 oracle: DetectionOracle | None = None, planner_config: Any = None, auto_layout: bool = True) -> None:
        super().__init__(job, perf, settings)
        from resihp.coordinator.planner import planner

        self._planner = planner
        self.config = planner_config if planner_config is not None else self._default_config()
        if auto_layout:
            self.plan = self._launch_layout()
        self.oracle = oracle or oracle_for(job)
        self.known_dead: set[int] = set()
        self.known_slow: dict[int, tuple[tuple[int, ...], float, str]] = {}  # fault id -> (ranks, factor, cause)
        self._in_flight: set[int] = set()  # fail-slows whose finding comes within their first slowed iteration
        self.verdict_at: dict[int, float] = {}  # fault id -> when its fail-slow was found
        # a slow rank the plan leaves idle is judged by its compute probes (None: no probes);
        # a verdict no probe renews lapses after spare_verdict_s
        self.detector_config = DetectorConfig()
        self.spare_verdict_s = self.detector_config.spare_verdict_s
        self.lapses: dict[int, tuple[float, float]] = {}  # fault id -> (its first verdict, when its latest lapsed)
        self.probe_every_s: float | None = PROBE_EVERY_S
        self.probe_runs = ProbeBook()  # runs of slow / normal probes, by fault id
        self.earlier: tuple[Plan, ...] = ()  # layouts run before the current one, most recent first (planner's ``earlier``)
        self.stalled = False  # a fail-stop hit the plan and no new plan runs yet
        self.waiting = False  # no feasible plan: waiting for repairs
        self.decisions = 0
        self.cache_hits = 0
        self.planner_s = 0.0
        self._faults: dict[int, FailStop | FailSlow] = {}

    def _launch_layout(self) -> Plan:
        """The layout resihp starts with, as ``resihp launch --layout auto`` (and ``hooks.init``
        without a plan) picks it: the planner's best healthy plan where the oracle runs it
        faster than the job's given layout, the plan the upper bound credits. Chosen before
        training: no pause, nothing moved."""
        from resihp.sim.runner import best_healthy_plan  # runner imports the policies package

        return best_healthy_plan(self.job, self.perf, self.config)

    def _default_config(self) -> Any:
        cfg_cls = getattr(self._planner, "PlannerConfig", None)
        if cfg_cls is None:
            from resihp.coordinator.planner.cost import PlannerConfig

            cfg_cls = PlannerConfig
        # the simulated runtime draws documents for its token shares (trainer_hooks' data path):
        # shares follow replica speed to within one document (docs/simulate.md)
        return cfg_cls(document_shares=True)

    # --- resihp's view of the cluster ---------------------------------------------------------
    def _view(self) -> tuple[dict[int, float], dict[int, float]]:
        """(compute speeds, link slowdown factors) as the detector reports them
        (``Detector.compute_speed()`` / ``link_factor()``)."""
        speeds: dict[int, float] = {}
        links: dict[int, float] = {}
        for ranks, factor, cause in self.known_slow.values():
            for r in ranks:
                if cause == "communication":
                    links[r] = max(links.get(r, 1.0), factor)
                else:
                    speeds[r] = min(speeds.get(r, 1.0), 1.0 / factor)
        return speeds, links

    def _cluster(self) -> Any:
        """The planner's view as a Cluster; the same view gives the same (immutable) object,
        so the planner's per-cluster tables are built once per distinct view."""
        speeds, links = self._view()
        key = (frozenset(self.known_dead), tuple(sorted(speeds.items())), tuple(sorted(links.items())))
        hit = _CLUSTERS.get(key)
        if hit is None or hit[0] is not self.job:
            if len(_CLUSTERS) > 64:
                _CLUSTERS.clear()
            hit = _CLUSTERS[key] = (self.job, self.job.cluster(speeds, sorted(self.known_dead), links))
        return hit[1]

    def _decide(self, finding: Finding | None, now: float) -> Any:
        """planner.decide, memoised on its inputs (it is a pure function; the simulated
        findings carry time_s = now, so ``now`` does not change the answer)."""
        import time

        speeds, links = self._view()
        fkey = None if finding is None else (finding.kind, finding.ranks, round(finding.factor, 6), finding.cause)
        # the current plan by identity (hashing a 16K-rank plan costs more than the lookup
        # saves); the entry holds the plan, so its id cannot be reused while cached
        key = (frozenset(self.known_dead), tuple(sorted(speeds.items())), tuple(sorted(links.items())), id(self.plan),
               tuple(id(p) for p in self.earlier), fkey)
        hit = _DECISIONS.get(key)
        if hit is not None and hit[0] is self.plan and all(a is b for a, b in zip(hit[2], self.earlier)):
            self.cache_hits += 1
            return hit[1]
        t0 = time.perf_counter()
        try:
            d = self._planner.decide(self._cluster(), self.job.model, self.job.batch(), self.plan, finding, now,
                                     self.config, earlier=self.earlier)
        finally:
            self.planner_s += time.perf_counter() - t0
            self.decisions += 1
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        _DECISIONS[key] = (self.plan, d, self.earlier)
        return d

    def _apply(self, finding: Finding | None, now: float, note: str, stalled_before: bool) -> Reaction:
        try:
            d = self._decide(finding, now)
        except SpecError as exc:
            self.waiting = True
            return Reaction(0.0, "down", note=f"{note}: planner found no plan ({exc}); waiting for repairs")
        if not d.act:
            if stalled_before:  # a fail-stop always needs a plan without the lost devices
                self.waiting = True
                return Reaction(0.0, "down", note=f"{note}: planner did not act ({d.reason}); waiting")
            return self.steady(f"{note}: planner keeps the plan ({d.reason})")
        self.earlier = earlier_layouts(self.earlier, self.plan, d.plan)  # as the coordinator's engine
        self.plan = d.plan
        self.stalled = self.waiting = False
        # the planner's own cost of the rung it chose: bytes moved / bandwidth + the rung's
        # fixed latency; after a fail-stop the communicators are rebuilt whatever the rung
        cost = next((c.cost_s for c in getattr(d, "candidates", ()) if c.level == d.level and c.plan.replicas == d.plan.replicas),
                    float(d.move_s) + self.settings.regroup_s)
        pause = max(cost, self.settings.regroup_s) if stalled_before else cost
        tps = self.rate()
        return Reaction(tps, self.label_for(tps), (Phase(pause, 0.0, "reconfig"),), reconfigurations=1,
                        note=f"{note}: {d.level}: {d.reason} (pause {pause:.1f} s)")

    def steady(self, note: str = "", **kw: object) -> Reaction:
        if self.stalled or self.waiting or self.plan_uses_dead(self.plan):
            return Reaction(0.0, "down", note=note, **kw)  # type: ignore[arg-type]
        return super().steady(note, **kw)

    # --- events -------------------------------------------------------------------------------
    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        f = ev.fault
        self._faults[ev.fault_id] = f
        if isinstance(f, FailStop):
            if ev.start:
                silent = f.scope == "node"
                delay = self.oracle.failstop_delay_s(silent)
                hit = any(self.plan.has_rank(r) for r in f.ranks) and not self.waiting
                lost = self.inflight_tokens(now) if hit and not self.stalled else 0.0
                if hit:
                    self.stalled = True
                timers = ((now + delay, f"stop:{ev.fault_id}"),) if math.isfinite(delay) else ()
                if hit:
                    return Reaction(0.0, "down", lost_tokens=lost, timers=timers, note=f"{ev.label}: job stalls")
                return self.steady(timers=timers)
            # repair: the agent reports the node back; the planner may re-admit it
            back = [r for r in f.ranks if r in self.known_dead and self.world.alive(r)]
            self.known_dead -= set(back)
            if not back:
                return self.steady()
            return self._apply(None, now, f"{ev.label}: {len(back)} device(s) back", self.waiting)
        assert isinstance(f, FailSlow)
        kind = "compute" if f.slow_kind == "compute" else "communication"
        det = self.oracle.failslow(kind, f.factor)
        if ev.start:
            if det.detect_iters is None:
                return self.steady(f"{ev.label}: not detected")
            if kind == "compute" and self.probe_every_s is not None and not any(self.plan.has_rank(r) for r in f.ranks):
                # idle devices: their probes find it (confirm_iters slow probes)
                confirm = self.detector_config.confirm_iters
                return self.steady(timers=((now + confirm * self.probe_every_s, f"slow:{ev.fault_id}"),))
            slowed, base = self._with_and_without(ev)
            if self._under_impact_floor(slowed, base):  # reported as degraded, the planner is not asked
                return self.steady(f"{ev.label}: degraded (costs under the impact floor), keeps the plan")
            t_iter = self.perf.iteration_s(self.plan, self.world)
            if not math.isfinite(t_iter):
                t_iter = self.perf.iteration_s(self.job.initial_plan(), self.world.__class__(self.world.world_size, self.world.gpus_per_node))
            delay = det.detect_iters * t_iter
            # found within the slowed iteration where it hears enough beats (detection.IN_FLIGHT_BEATS)
            dc = self.detector_config
            if (det.in_flight_share is not None and dc.in_flight and math.isfinite(base)
                    and base >= max(detection.IN_FLIGHT_BEATS * detection.HEARTBEAT_S, dc.in_flight_min_iteration_s)):
                delay = min(delay, det.in_flight_share * t_iter)
                self._in_flight.add(ev.fault_id)
            return self.steady(timers=((now + delay, f"slow:{ev.fault_id}"),))
        if ev.fault_id not in self.known_slow:
            return self.steady()
        if not any(self.plan.has_rank(r) for r in self.known_slow[ev.fault_id][0]):
            return self.steady()  # idle ranks: their probes (or the verdict's lapse) bring them back
        t_iter = self.perf.iteration_s(self.plan, self.world)
        iters = det.recover_iters if det.recover_iters is not None else 10
        wait = iters * (t_iter if math.isfinite(t_iter) else 60.0)
        return self.steady(timers=((now + wait, f"recovered:{ev.fault_id}"),))

    def _with_and_without(self, ev: WorldEvent) -> tuple[float, float]:
        """The running plan's iteration in the world with the fault ``ev`` and without it
        (applying is idempotent)."""
        worlds = []
        for start in (True, False):
            w = copy.deepcopy(self.world)
            w.apply(WorldEvent(ev.time_s, ev.fault, ev.fault_id, start))
            worlds.append(w)
        slowed, base = (self.perf.iteration_s(self.plan, w) for w in worlds)
        return slowed, base

    def _under_impact_floor(self, slowed: float, base: float) -> bool:
        """Whether the slowdown costs the running plan less than the detector's impact floor: its
        iteration against the same world without this fault (``_with_and_without``), as the
        detector's schedule simulation prices a finding on the real job. (The detection
        probe's own verdict prices the probe's fault — one P2P link of a 2 × 2 proxy job —, not
        this one: a node's congested NIC also slows its DP ring, which cost a whole job 17 %
        while the probe called a 3.5× link slowdown under the floor.)"""
        if not (math.isfinite(slowed) and math.isfinite(base)) or slowed <= 0.0:
            return False
        return (slowed - base) / slowed < self.detector_config.impact_floor

    def on_timer(self, tag: str, now: float) -> Reaction:
        kind, _, rest = tag.partition(":")
        fid = int(rest)
        ev = self._fault(fid)
        if kind == "stop":
            assert isinstance(ev, FailStop)
            dead = [r for r in ev.ranks if not self.world.alive(r)]
            if not dead:
                self.stalled = False if not self.plan_uses_dead(self.plan) else self.stalled
                return self.steady("fail-stop cleared before detection")
            self.known_dead |= set(dead)
            if not any(self.plan.has_rank(r) for r in dead) and not self.stalled:
                return self.steady(f"fail-stop#{fid} of idle devices noted")
            finding = self._finding("fail-stop", dead, 1.0, "process-exit" if ev.scope != "node" else "heartbeat", now)
            return self._apply(finding, now, f"fail-stop#{fid} detected", True)
        if kind == "slow":
            assert isinstance(ev, FailSlow)
            if not self._active(fid):
                return self.steady()
            det = self.oracle.failslow("compute" if ev.slow_kind == "compute" else "communication", ev.factor)
            ranks = ev.ranks if ev.slow_kind == "compute" else tuple(
                r for n in sorted({self.world.node_of(x) for x in ev.ranks}) for r in node_ranks(self.job, n))
            factor = (self.oracle.estimated_in_flight_factor(det, ev.factor) if fid in self._in_flight
                      else self.oracle.estimated_factor(det, ev.factor))
            self._in_flight.discard(fid)
            self.known_slow[fid] = (tuple(ranks), factor, det.cause)
            self.verdict_at[fid] = now
            finding = self._finding("fail-slow", ranks, factor, det.cause, now)
            res = self._apply(finding, now, f"fail-slow#{fid} detected ×{factor:.2f}", False)
            timers: tuple[tuple[float, str], ...] = ((now + self._hold_s(fid), f"lapse:{fid}"),)
            if det.cause != "communication" and self.probe_every_s is not None:
                self.probe_runs.forget_runs(fid)
                timers += ((now + self.probe_every_s, f"probe:{fid}"),)
            return replace(res, timers=res.timers + timers)
        if kind == "probe":
            return self._probe(fid, now)
        if kind == "lapse":
            # as Detector.tick: the verdict of ranks the plan left idle lapses into a recovery
            entry = self.known_slow.get(fid)
            if entry is None:
                return self.steady()  # recovered meanwhile
            due = self.verdict_at.get(fid, now) + self._hold_s(fid)
            if now < due - 1e-6:  # a slow probe renewed the verdict: lapse from then on
                return self.steady(timers=((due, f"lapse:{fid}"),))
            if self._active(fid) and any(self.plan.has_rank(r) for r in entry[0]):
                return self.steady()  # in the plan: its own timings keep judging it
            self.lapses[fid] = (self._fault_onset(fid, now), now)
            del self.known_slow[fid]
            finding = self._finding("recovered", entry[0], 1.0, entry[2], now)
            res = self._apply(finding, now, f"fail-slow#{fid}: verdict lapsed", False)
            if self._active(fid) and any(self.plan.has_rank(r) for r in entry[0]):
                # back in the plan while still slow: the detector finds it again
                assert isinstance(ev, FailSlow)
                det = self.oracle.failslow("compute" if ev.slow_kind == "compute" else "communication", ev.factor)
                t_iter = self.perf.iteration_s(self.plan, self.world)
                if det.detect_iters is not None and math.isfinite(t_iter):
                    res = replace(res, timers=res.timers + ((now + det.detect_iters * t_iter, f"slow:{fid}"),))
            return res
        if kind == "recovered":
            entry = self.known_slow.pop(fid, None)
            if entry is None:
                return self.steady()
            finding = self._finding("recovered", entry[0], 1.0, entry[2], now)
            return self._apply(finding, now, f"recovery#{fid} detected", False)
        return self.steady()

    def _fault_onset(self, fid: int, now: float) -> float:
        """As ``IdleRankVerdicts._fault_onset``: the first verdict of a fault found again within
        spare_verdict_s of its latest lapse, else the current verdict."""
        given = self.verdict_at.get(fid, now)
        onset, lapsed_at = self.lapses.get(fid, (given, -math.inf))
        return onset if given - lapsed_at <= self.spare_verdict_s else given

    def _hold_s(self, fid: int) -> float:
        """As ``IdleRankVerdicts.verdict_hold_s``: as long as the fault had lasted, within
        [1, MAX_LAPSE_SCALE] × spare_verdict_s."""
        given = self.verdict_at.get(fid, 0.0)
        lasted = given - self._fault_onset(fid, given)
        return min(MAX_LAPSE_SCALE * self.spare_verdict_s, max(self.spare_verdict_s, lasted))

    def _probe(self, fid: int, now: float) -> Reaction:
        """An idle slow rank's compute probe, judged by the detector's own rule (``judge_probe``);
        the probe reads the devices' true slowdown."""
        entry = self.known_slow.get(fid)
        if entry is None or self.probe_every_s is None:
            return self.steady()  # recovered (or readmitted and judged by its iterations)
        nxt = ((now + self.probe_every_s, f"probe:{fid}"),)
        if any(self.plan.has_rank(r) for r in entry[0]):
            self.probe_runs.forget_runs(fid)
            return self.steady(timers=nxt)  # in the plan: its iterations judge it
        ratio = max(max(self.world.slow.get(r, {}).values(), default=1.0) for r in entry[0])
        slow = is_slow_probe(ratio, self.detector_config)
        action = judge_probe(True, slow, self.probe_runs.count(fid, slow), self.detector_config)
        if action == "renew":
            self.verdict_at[fid] = now
        if action != "recovered":
            return self.steady(timers=nxt)
        del self.known_slow[fid]
        self.probe_runs.forget_runs(fid)
        finding = self._finding("recovered", entry[0], 1.0, entry[2], now)
        return self._apply(finding, now, f"fail-slow#{fid}: idle ranks' probes normal", False)

    # --- helpers --------------------------------------------------------------------------------
    def _fault(self, fid: int) -> FailStop | FailSlow:
        return self._faults[fid]

    def _active(self, fid: int) -> bool:
        return any(fid in d for d in self.world.slow.values()) or any(fid in d for d in self.world.net.values())

    def _finding(self, kind: str, ranks: Any, factor: float, cause: str, now: float) -> Finding:
        ranks = tuple(sorted(ranks))
        pos = self.plan.position(ranks[0]) if self.plan.has_rank(ranks[0]) else None
        group = self.plan.replicas[pos.replica].stages[pos.stage] if pos else None
        return Finding(
            iteration=0, kind=kind, ranks=ranks, stage=pos.stage if pos else None,  # type: ignore[arg-type]
            replica=pos.replica if pos else None, tp_group=group, factor=factor, cause=cause,
            reason=f"simulated {kind} on ranks {list(ranks)[:8]}", evidence={}, time_s=now,
        )


__all__ = ["ResiHP", "oracle_for"]
