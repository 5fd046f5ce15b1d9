"""Liveness on the coordinator's own clock: the agents' heartbeats, ranks silent past the
heartbeat timeout, and hangs — a job with no iteration for the engine's hang time, with a rank
of the plan silent while its peers beat on, is held up by that rank (a stopped process, a
frozen host); with every rank beating on, by the rank that waits for nobody while its peers
wait for it in p2p or collective ops (the ops the heartbeats name). A part of
``CoordinatorCore`` (coordinator/service/core.py), kept in its own module; every method runs
under the core's lock.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resihp.coordinator.detector.hangs import hang_culprits, stuck_culprits, stuck_reason
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ExitEvent
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.records import RankInfo

if TYPE_CHECKING:
    from resihp.coordinator.service.config import CoordinatorConfig
    from resihp.coordinator.service.engine import Engine
    from resihp.coordinator.service.metrics import Registry
    from resihp.coordinator.service.records import AgentConn, Pending


class LivenessFlow:
    """Mixed into ``CoordinatorCore``: the method below uses its state."""

    ranks: dict[int, RankInfo]
    plan: Plan
    engine: Engine
    last_iteration: int
    _progress_at: float | None
    pending: Pending | None

    config: CoordinatorConfig
    metrics: Registry
    policy: dict[str, str]

    if TYPE_CHECKING:
        def _where(self, rank: int) -> dict[str, Any]: ...
        def _valid_item(self, rank: int, what: str) -> bool: ...

    def _on_heartbeat(self, conn: AgentConn, hb: m.AgentHeartbeat, now: float) -> None:
        conn.sampler_degraded, conn.sampler_status = hb.sampler_degraded, hb.sampler_status
        self.metrics.set("resihp_agent_sampler_degraded", 1 if hb.sampler_degraded else 0,
                         {"node": conn.node, "job": self.config.job})
        for rh in hb.ranks:
            if not self._valid_item(rh.rank, "heartbeat"):
                continue
            seen = now - max(0.0, hb.time_s - rh.time_s)  # age on the agent's clock, skew-free
            info = self.ranks[rh.rank]
            if info.last_seen is None or seen > info.last_seen:
                # Liveness is the control plane's own clock (tick); per-rank beats are not fed to the
                # engine: at 1,024 ranks its per-beat timeout scan would dominate the coordinator.
                info.last_seen = seen
                if rh.op is None or rh.op != info.op:
                    info.op_since = seen  # a new op (or none): how long one is held counts from here
                info.op, info.op_at = rh.op, seen
                if rh.op is not None:  # the detector's in-flight judging (one O(1) update a beat)
                    self.engine.observe_op(rh.rank, seen, rh.op)

    def _silent(self, now: float, unjudged: set[int], found: list[m.FindingInfo]) -> list[m.FindingInfo]:
        """Fail-stop verdicts on ranks silent past the heartbeat timeout (not those whose agent is
        lost and in its grace, ``unjudged``, nor those ``found`` already names)."""
        timeout = float(self.policy["heartbeat_timeout_s"])
        out = []
        for r, info in self.ranks.items():
            if info.dead or info.finished or info.last_seen is None or r in unjudged:
                continue
            if now - info.last_seen > timeout and not any(r in f.ranks for f in found):
                # tell the engine too, so its rank state (and speed estimate) says dead
                self.engine.observe(ExitEvent(r, now, m.EXIT_UNKNOWN), now)
                out.append(m.FindingInfo(self.last_iteration, "fail-stop", (r,), "heartbeat", 1.0,
                                         f"rank {r} silent for {now - info.last_seen:.2f} s "
                                         f"(heartbeat timeout {timeout} s); node {info.node or '?'}",
                                         now, **self._where(r)))
        return out

    def _hung(self, now: float) -> list[m.FindingInfo]:
        """No iteration for the engine's hang time, with a rank of the plan silent while its
        peers beat on: that rank holds the job up (stopped, frozen host). Fail-stop, cause
        no-progress, long before the heartbeat timeout (coordinator/detector/detector.py,
        hang_culprits; liveness is this process's own clock of when each rank was heard)."""
        if self._progress_at is None or self.pending is not None:
            # a switch in progress pauses the iterations by design (state moves, groups form):
            # the ack timeout, not the hang rule, watches it
            return []
        stalled, wait = now - self._progress_at, self.engine.hang_after_s()
        if stalled <= wait:  # every tick: no per-rank work while iterations come
            return []
        silence = {r: now - info.last_seen for r, info in self.ranks.items()
                   if not info.dead and not info.finished and info.last_seen is not None and self.plan.has_rank(r)}
        out = []
        op_held = self._op_held(list(silence))
        held = hang_culprits(stalled, wait, silence, op_held)
        if not held:
            return self._stuck(now, stalled, wait, list(silence), op_held)
        for r in held:
            self.engine.observe(ExitEvent(r, now, m.EXIT_UNKNOWN), now)  # its engine state says dead too
            out.append(m.FindingInfo(
                self.last_iteration, "fail-stop", (r,), "no-progress", 1.0,
                f"no iteration for {stalled:.1f} s (hang after {wait:.1f} s); rank {r} silent for {silence[r]:.1f} s while "
                f"its peers beat on: a stopped process or frozen host holds the job up; node {self.ranks[r].node or '?'}",
                now, **self._where(r)))
        return out

    def _op_held(self, live: list[int]) -> dict[int, float]:
        """Per rank whose beats name ops: seconds from the first to the latest beat that named
        the op it is in."""
        return {r: at - since for r in live if self.ranks[r].op is not None
                and (since := self.ranks[r].op_since) is not None and (at := self.ranks[r].op_at) is not None}

    def _stuck(self, now: float, stalled: float, wait: float, live: list[int],
               held: dict[int, float]) -> list[m.FindingInfo]:
        """Every rank beats on: the ranks its peers wait for (``stuck_culprits``)."""
        ops = {r: self.ranks[r].op for r in live}
        ages = {r: now - at for r in live if (at := self.ranks[r].op_at) is not None}
        out = []
        for r in stuck_culprits(stalled, wait, ops, ages, held):
            self.engine.observe(ExitEvent(r, now, m.EXIT_UNKNOWN), now)  # its engine state says dead too
            out.append(m.FindingInfo(
                self.last_iteration, "fail-stop", (r,), "no-progress", 1.0,
                f"{stuck_reason(r, ops, stalled, wait)}; node {self.ranks[r].node or '?'}", now, **self._where(r)))
        return out
