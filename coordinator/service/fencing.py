"""Dead means fenced; an agent is not its ranks. A part of ``CoordinatorCore``
(coordinator/service/core.py), kept in its own module; every method runs under the core's lock.

A rank declared dead while its process may still live (silent, stuck, a stopped process)
is fenced: its node's agent SIGKILLs it, so the survivors' collectives and MPI's shrink stop
waiting for it, and it can never wake into a job that has moved on. An order whose agent is
gone is kept and sent again when that node's agent registers (its launcher restarts it); a
fenced rank that shows up again is fenced again.

An agent whose stream ended is not taken for its ranks' death: for ``agent_grace_s`` their
silence counts against nobody (no heartbeat verdict, no hang verdict), and while the job's
iterations go on they are alive — a synchronous step cannot finish without every rank of
the plan.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m

if TYPE_CHECKING:
    from resihp.coordinator.service.config import CoordinatorConfig
    from resihp.coordinator.service.journal import EventLog
    from resihp.coordinator.service.records import AgentConn, RankInfo

# causes whose process is gone already: nothing to fence
GONE_CAUSES = ("process-exit",)


class FenceFlow:
    """Mixed into ``CoordinatorCore``: the methods below use its state."""

    config: CoordinatorConfig
    ranks: dict[int, RankInfo]
    agents: dict[str, AgentConn]
    events: EventLog
    plan: Plan
    _progress_at: float | None
    fences: dict[int, m.KillOrder]  # rank -> the order, until its process is seen gone

    lost_agents: dict[str, float]  # node -> when its agent's stream ended (coordinator clock)

    def _agent_on(self, node: str) -> AgentConn | None:
        for conn in self.agents.values():
            if conn.node == node and conn.streaming:
                return conn
        return None

    # --- fences -----------------------------------------------------------------------
    def _fence(self, f: m.FindingInfo, ranks: list[int]) -> None:
        """Order the fence of every rank a fail-stop verdict names whose process may live."""
        if f.cause in GONE_CAUSES:
            return
        for r in ranks:
            info = self.ranks[r]
            order = m.KillOrder(r, f"fence: {f.cause}: {f.reason}"[:400], fence=True, pid=info.pid)
            self.fences[r] = order
            self._send_fence(order, "declared dead")

    def _send_fence(self, order: m.KillOrder, why: str, conn: AgentConn | None = None) -> None:
        """Put ``order`` in the outbox of ``conn`` (default: the node's streaming agent; an agent
        still registering is given explicitly), or record that it waits for one."""
        info = self.ranks[order.rank]
        conn = conn or self._agent_on(info.node)
        if conn is None:
            self.events.emit("fence", rank=order.rank, node=info.node, pid=order.pid, sent=False,
                             reason=f"rank {order.rank} {why}; no agent on {info.node or '?'} to fence it: "
                                    f"the order waits for the agent's restart")
            return
        conn.outbox.put(m.CoordinatorBatch(kills=(order,)))
        self.events.emit("fence", rank=order.rank, node=conn.node, pid=order.pid, sent=True,
                         reason=f"rank {order.rank} {why}: SIGKILL ordered on {conn.node} (pid {order.pid})")

    def _fence_result(self, conn: AgentConn, inj: m.InjectResult) -> None:
        if inj.ok:
            self.fences.pop(inj.rank, None)
        self.events.emit("fence-result", rank=inj.rank, ok=inj.ok, node=conn.node, reason=inj.detail)

    def _fence_gone(self, rank: int) -> None:
        """The rank's process was seen to exit: its fence is done."""
        self.fences.pop(rank, None)

    def _came_back(self, conn: AgentConn, rank: int) -> None:
        """A rank declared dead announced again with the same process: fence it (again)."""
        info = self.ranks[rank]
        order = self.fences.get(rank) or m.KillOrder(rank, f"fence: declared dead: {info.dead_reason}"[:400],
                                                     fence=True, pid=info.pid)
        self.fences[rank] = order
        self._send_fence(order, f"(pid {info.pid}) showed up after it was declared dead ({info.dead_reason}); "
                                f"its epoch is stale", conn)

    # --- lost agents ----------------------------------------------------------------------
    def _agent_lost(self, conn: AgentConn, now: float) -> None:
        ranks = sorted(r for r, i in self.ranks.items() if i.node == conn.node and not i.dead and not i.finished)
        if ranks and self._agent_on(conn.node) is None:  # (an agent whose ranks all left just ends)
            self.lost_agents[conn.node] = now
            self.events.emit("agent-lost", node=conn.node, ranks=ranks,
                             reason=f"the agent on {conn.node} is gone; ranks {ranks} are not judged by their "
                                    f"silence for {self.config.agent_grace_s:.0f} s, while it restarts")

    def _agent_back(self, conn: AgentConn, now: float) -> None:
        """A node's agent (re)registered: its fences go out again. Its ranks stay unjudged until
        each has said hello to it again (``_rejoined``): until then their reports cannot flow."""
        since = self.lost_agents.get(conn.node)
        if since is not None:
            self.events.emit("agent-back", node=conn.node, agent_id=conn.agent_id,
                             reason=f"the agent on {conn.node} is back after {now - since:.1f} s")
            self._rejoined(conn, now)
        for r, order in list(self.fences.items()):
            if self.ranks[r].node == conn.node:
                self._send_fence(order, "was declared dead; the order goes to the restarted agent", conn)

    def _rejoined(self, conn: AgentConn, now: float) -> None:
        """Once every live rank of a lost agent's node has met its new agent, the node is judged
        again, and the hang clock restarts: iterations that could not be reported meanwhile were
        no hang."""
        if conn.node not in self.lost_agents:
            return
        waiting = [r for r, i in self.ranks.items() if i.node == conn.node and not i.dead and not i.finished
                   and r not in conn.ranks]
        if waiting:
            return
        del self.lost_agents[conn.node]
        if self._progress_at is not None:
            self._progress_at = max(self._progress_at, now)
        for r in conn.ranks:
            info = self.ranks[r]
            info.last_seen = now if info.last_seen is None else max(info.last_seen, now)

    def _unjudged(self, now: float) -> set[int]:
        """Ranks whose agent is lost and within its grace: their silence says nothing. Those of
        the plan are vouched for by the job's progress (their ``last_seen`` follows it)."""
        out: set[int] = set()
        grace = self.config.agent_grace_s
        for node, since in self.lost_agents.items():
            for r, info in self.ranks.items():
                if info.node != node or info.dead or info.finished:
                    continue
                if self._progress_at is not None and self.plan.has_rank(r) and info.last_seen is not None:
                    info.last_seen = max(info.last_seen, self._progress_at)
                if now - since <= grace:
                    out.add(r)
        return out
