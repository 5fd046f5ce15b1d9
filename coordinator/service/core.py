"""The coordinator's brain, free of gRPC: liveness, joining, findings, commands, acks.

``CoordinatorCore`` is driven by three inputs — agent batches, ``tick()`` and admin
calls — all serialised under one lock, with time from an injected clock. Its decisions
come from an ``Engine`` (detector + planner); the lifecycle is the pure state machine in
``statemachine.py``; everything a restart needs goes to the ``Journal``. Outgoing traffic
is put on per-agent outboxes that the gRPC layer drains.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ExitEvent, PlanChange
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.service.admin import SERVICE_POLICY, CoordinatorAdmin, Refused
from resihp.coordinator.service.audit import Audits, Regret
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.engine import Engine
from resihp.coordinator.service.fencing import FenceFlow
from resihp.coordinator.service.joiner import Joiner, LayoutCheck
from resihp.coordinator.service.journal import EventLog, Journal, JournalState
from resihp.coordinator.service.liveness import LivenessFlow
from resihp.coordinator.service.metrics import Registry
from resihp.coordinator.service.observe import ObserveFlow
from resihp.coordinator.service.planning import PlanFlow, worth_acting
from resihp.coordinator.service.records import AgentConn, Pending, RankInfo, record_gpu_sample
from resihp.coordinator.service.statemachine import State, Trigger, can, step
from resihp.coordinator.service.trace_sink import TraceSink

log = logging.getLogger(__name__)


class CoordinatorCore(PlanFlow, ObserveFlow, LivenessFlow, FenceFlow):
    def __init__(self, config: CoordinatorConfig, plan: Plan, engine: Engine, journal: Journal, events_path: Any,
                 registry: Registry, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.engine = engine
        self.journal = journal
        self.metrics = registry
        self.lock = threading.RLock()
        saved = journal.load()
        self.resumed = saved.t0 > 0
        self.t0 = saved.t0 if self.resumed else clock()
        self.events = EventLog(events_path, config.job, clock)
        self.plan: Plan = saved.plan if saved.plan is not None else plan
        self.epoch = max(saved.epoch, self.plan.epoch)
        self.engine_epoch = self.plan.epoch  # the plan the engine judges records by
        self.seq = saved.seq
        self.state = State(saved.state) if self.resumed and saved.state in State.__members__ else State.RUNNING
        self.state_reason = saved.state_reason or "job started"
        self.excluded: set[int] = set(saved.excluded)
        self.ranks: dict[int, RankInfo] = {r: RankInfo(r) for r in range(config.world_size)}
        self._live_cache: frozenset[int] | None = None
        self.agents: dict[str, AgentConn] = {}
        self.fences: dict[int, m.KillOrder] = {}  # coordinator/service/fencing.py
        self.lost_agents: dict[str, float] = {}
        self.pending: Pending | None = None
        self.queued_findings: list[m.FindingInfo] = []
        self.degraded_only: set[int] = set()  # slow verdicts never acted on (planning.worth_acting)
        self.audits = Audits()  # did the planner's own switches pay off? (coordinator/service/audit.py)
        self.audits.regrets = {i: Regret.from_json(r) for i, r in saved.regrets.items()}
        self.policy: dict[str, str] = {"auto_reconfigure": "on" if config.auto_reconfigure else "off",
                                       "apply_margin": str(config.apply_margin),
                                       "ack_timeout_s": str(config.ack_timeout_s),
                                       "heartbeat_timeout_s": str(config.heartbeat_timeout_s),
                                       "plan_audit": "on" if config.plan_audit else "off",
                                       "audit_margin": str(config.audit_margin)}
        self.admin = CoordinatorAdmin(self)  # operator requests (coordinator/service/admin.py)
        # service keys of the configured policy (the engine takes the others), then the journal's
        self.admin._apply_policy({k: v for k, v in config.policy.items() if k in SERVICE_POLICY}, journal_it=False)
        self.admin._apply_policy(saved.policy, journal_it=False)
        self.joiner = Joiner(self.plan, self.t0, config.join_grace_s)
        self.joiner.resume_after(saved.last_iteration)
        self.last_iteration = saved.last_iteration
        self._agent_ids = itertools.count(1)
        self.last_finding: m.FindingInfo | None = None
        self.model_json = ""  # the ModelSpec the trainers said they train (coordinator/service/observe.py)
        self._own_loop_detection = False  # noise-adaptive detection was set up for an observe-only job
        self._progress_at: float | None = None  # when the latest iteration record was joined
        self._layout = LayoutCheck(open=not self.resumed and self.seq == 0)  # the trainers' layout vs the plan
        self.listeners: list[Callable[[str, Any], None]] = []  # tests and the bench observe findings here
        self.trace: TraceSink | None = None  # the job's joined trace (service.py opens <run-dir>/trace.jsonl)
        if self.resumed:
            journal.start(config.job, self.t0)
            for r, info in self.ranks.items():  # every live rank must show up again within the timeout
                info.last_seen = self.now() + 2.0
                info.finished = r in saved.finished
                if r in saved.dead:
                    info.pid, info.dead_reason = saved.dead[r]
                    info.dead = True
            self.events.emit("coordinator-resumed", epoch=self.epoch, seq=self.seq, state=self.state.value,
                             reason=f"journal replayed: epoch {self.epoch}, last command {self.seq}, "
                                    f"last iteration {saved.last_iteration}")
            self.engine.set_plan(self.plan, max(saved.last_iteration, 0))
            self._resume_pending(saved)
        else:
            journal.start(config.job, self.t0)
            journal.plan(self.plan)
            self.events.emit("coordinator-started", epoch=self.epoch, world_size=config.world_size,
                             engine=engine.name, reason="job started", plan=self.plan.to_dict())

    # --- helpers ----------------------------------------------------------------------
    def now(self) -> float:
        """Job-relative seconds (the trace's time base)."""
        return self.clock() - self.t0

    def _resume_pending(self, saved: JournalState) -> None:
        if self.state is State.RECONFIGURING and saved.pending_seq:
            # hooks de-duplicate by seq: re-send the same command and wait for acks again
            raw = self.journal.last_command()
            if raw is not None and raw.get("kind") == "reconfigure":
                cmd = m.ReconfigCommand(epoch=int(raw["epoch"]), plan=Plan.from_dict(raw["plan"]),
                                        apply_at=int(raw["apply_at"]), reason=str(raw.get("reason", "")),
                                        seq=int(raw["seq"]), issued_s=float(raw.get("issued_s", 0.0)))
                self.joiner.add_plan(cmd.plan)
                self.pending = Pending(cmd, set(self._live_ranks()), self.now())
                return
        if self.state in (State.PLANNING, State.RECONFIGURING):
            self._transition(Trigger.ACK_TIMEOUT if self.state is State.RECONFIGURING else Trigger.KEEP,
                             "coordinator restarted mid-decision; resuming on the journaled plan")

    def _live_ranks(self) -> list[int]:
        return [r for r, info in self.ranks.items() if not info.dead and not info.finished]

    def live_set(self) -> frozenset[int]:
        if self._live_cache is None:  # recomputed only after a rank died, finished or came back
            self._live_cache = frozenset(self._live_ranks())
        return self._live_cache

    def _transition(self, trigger: Trigger, reason: str) -> bool:
        if not can(self.state, trigger):
            return False
        t = step(self.state, trigger, reason)
        self.state, self.state_reason = t.after, reason
        self.journal.state(t.after.value, reason)
        self.events.emit("state", epoch=self.epoch, **t.to_json())
        return True

    def _notify(self, kind: str, payload: Any) -> None:
        for listener in self.listeners:
            try:
                listener(kind, payload)
            except Exception:  # a listener must never break the coordinator
                log.exception("listener failed")

    # --- agents -----------------------------------------------------------------------
    def register(self, reg: m.Registration) -> tuple[AgentConn, m.Welcome]:
        with self.lock:
            if reg.job and reg.job != self.config.job:
                raise ValidationError(f"agent of job {reg.job!r} tried to join job {self.config.job!r}")
            for lr in reg.ranks:
                self._check_rank(lr.rank, "register.ranks")
            for old in [a for a in self.agents.values() if a.node == reg.node]:
                self._drop_agent(old, "replaced by a new registration from the same node")
            conn = AgentConn(f"{reg.node}#{next(self._agent_ids)}", reg.node,
                             sampler_degraded=reg.sampler_degraded, sampler_status=reg.sampler_status)
            self.agents[conn.agent_id] = conn
            self._agent_back(conn, self.now())
            for lr in reg.ranks:
                self._join_rank(conn, lr)
            self.events.emit("agent-registered", node=reg.node, agent_id=conn.agent_id,
                             ranks=sorted(conn.ranks), address=reg.address, sampler=reg.sampler_status,
                             reason=f"agent on {reg.node} registered with ranks {sorted(conn.ranks)}")
            welcome = m.Welcome(conn.agent_id, self.epoch, self.seq, self.config.world_size,
                                self.config.heartbeat_interval_s, self.plan)
            if self.pending is not None:
                conn.outbox.put(m.CoordinatorBatch(commands=(self.pending.command,)))
            return conn, welcome

    def _join_rank(self, conn: AgentConn, lr: m.LocalRank) -> None:
        info = self.ranks[lr.rank]
        if info.dead and info.pid == lr.pid and lr.pid:
            # the same process, announced alive after it was declared dead: fenced, not readmitted
            self._came_back(conn, lr.rank)
            return
        conn.ranks.add(lr.rank)
        self._capability(lr)
        info.node, info.local_rank = conn.node, lr.local_rank
        if lr.pid and lr.pid != info.pid and info.dead:
            info.dead, info.dead_reason = False, ""  # a new process for that rank
            self._live_cache = None
            self.journal.rank_state(lr.rank, "alive")
        info.pid = lr.pid or info.pid
        info.last_seen = self.now()
        self._rejoined(conn, info.last_seen)

    def agent(self, agent_id: str) -> AgentConn:
        with self.lock:
            conn = self.agents.get(agent_id)
            if conn is None:
                raise Refused(f"unknown agent id {agent_id!r}; call Register first (the coordinator may have restarted)")
            return conn

    def stream_opened(self, conn: AgentConn) -> None:
        with self.lock:
            conn.streaming = True
            self.metrics.set("resihp_agents_connected", sum(a.streaming for a in self.agents.values()),
                             {"job": self.config.job})

    def stream_closed(self, conn: AgentConn, why: str) -> None:
        with self.lock:
            if self.agents.get(conn.agent_id) is conn:
                conn.streaming = False
                self.events.emit("agent-disconnected", node=conn.node, agent_id=conn.agent_id, reason=why)
                self._agent_lost(conn, self.now())
            self.metrics.set("resihp_agents_connected", sum(a.streaming for a in self.agents.values()),
                             {"job": self.config.job})

    def _drop_agent(self, conn: AgentConn, why: str) -> None:
        self.agents.pop(conn.agent_id, None)
        conn.outbox.put(None)  # ends its stream
        self.events.emit("agent-replaced", node=conn.node, agent_id=conn.agent_id, reason=why)

    def _check_rank(self, rank: int, name: str) -> None:
        if not 0 <= rank < self.config.world_size:
            raise ValidationError(f"{name}: rank {rank} is out of range; this job has ranks 0..{self.config.world_size - 1}")

    def _send_all(self, batch: m.CoordinatorBatch) -> None:
        for conn in self.agents.values():
            conn.outbox.put(batch)

    # --- the agent stream -------------------------------------------------------------
    def on_batch(self, conn: AgentConn, batch: m.AgentBatch) -> None:
        """Apply one agent message. Items naming ranks outside the job are dropped and counted; an
        item whose handling fails is logged and counted, and the stream goes on (one bad report
        must not cut a node off the coordinator)."""
        with self.lock:
            now = self.now()
            for lr in batch.joined:
                if self._valid_item(lr.rank, "joined"):
                    self._safely("joined", self._join_rank, conn, lr)
            for rep in batch.reports:
                self._safely("report", self._on_report, conn, rep, now)
            if batch.heartbeat is not None:
                self._safely("heartbeat", self._on_heartbeat, conn, batch.heartbeat, now)
            for ex in batch.exits:
                if self._valid_item(ex.rank, "exit"):
                    self._safely("exit", self._on_exit, ex, now)
            for ack in batch.acks:
                if self._valid_item(ack.rank, "ack"):
                    self._safely("ack", self._on_ack, ack, now)
            for g in batch.gpus:
                self._safely("gpu", self._on_gpu, conn, g)
            for p in batch.processes:
                if self._valid_item(p.rank, "process"):
                    lab = {"rank": p.rank, "node": conn.node, "job": self.config.job}
                    self.metrics.set("resihp_rank_cpu_seconds_total", p.cpu_seconds_total, lab)
                    self.metrics.set("resihp_rank_resident_memory_bytes", p.rss_bytes, lab)
            for pr in batch.probes:
                if self._valid_item(pr.rank, "probe"):
                    self._safely("probe", self._on_probe, pr, now)
            for inj in batch.injections:
                if inj.kind == "fence" and self._valid_item(inj.rank, "fence"):
                    self._fence_result(conn, inj)
                    continue
                self.events.emit("inject-result", kind=inj.kind, rank=inj.rank, ok=inj.ok, node=conn.node,
                                 reason=inj.detail)

    def _safely(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a bug in one handler must not end the agent's stream
            log.exception("coordinator: handling a %s failed; the item is dropped", what)
            self.metrics.inc("resihp_internal_errors_total", 1, {"job": self.config.job, "kind": what})

    def _valid_item(self, rank: int, what: str) -> bool:
        if 0 <= rank < self.config.world_size:
            return True
        self.metrics.inc("resihp_requests_invalid_total", 1, {"job": self.config.job, "kind": what})
        log.warning("dropped %s for rank %d: outside 0..%d", what, rank, self.config.world_size - 1)
        return False

    def _on_report(self, conn: AgentConn, rep: m.RankReport, now: float) -> None:
        if not self._valid_item(rep.rank, "report"):
            return
        if rep.epoch > self.epoch and self.pending is None and rep.epoch <= self.epoch + 8:
            self._trainers_epoch(rep.epoch, now)
        if rep.epoch > self.epoch:
            self.metrics.inc("resihp_requests_invalid_total", 1, {"job": self.config.job, "kind": "epoch"})
            log.warning("dropped report of rank %d: unknown epoch %d (current %d)", rep.rank, rep.epoch, self.epoch)
            return
        self._check_layout(rep, now)
        info = self.ranks[rep.rank]
        if rep.iteration >= info.iteration:
            info.iteration_end_s = rep.start_s + rep.step_s
        info.last_seen, info.iteration, info.step_s = now, max(info.iteration, rep.iteration), rep.step_s
        self.metrics.inc("resihp_reports_total", 1, {"job": self.config.job})
        self.metrics.set("resihp_rank_step_duration_seconds", rep.step_s,
                         {"rank": rep.rank, "node": info.node, "job": self.config.job})
        late = self.joiner.late
        records = self.joiner.add(rep, now, self.live_set())
        if self.joiner.late != late:
            self.metrics.inc("resihp_reports_late_total", 1, {"job": self.config.job})
        for rec in records:
            self._on_record(rec, now)

    @property
    def layout_mismatch(self) -> str:
        """Why the trainers' layout is not one this coordinator can follow ("" while it is)."""
        return self._layout.said

    def _check_layout(self, rep: m.RankReport, now: float) -> None:
        """The plan follows the trainers' micro-batch shares until something is commanded;
        after that a report that does not fit is said once, loudly (joiner.LayoutCheck)."""
        if rep.epoch != self.plan.epoch:
            return
        self._layout.open = self._layout.open and self.seq == 0  # a command fixed the plan the ranks run
        got = self._layout.check(self.plan, rep)
        if isinstance(got, Plan):
            was, self.plan = self.plan.describe(), got
            self.joiner.add_plan(got)
            self.journal.plan(got)
            self._adopt(got, max(rep.iteration, 0), now)
            if self.trace is not None:
                self.trace.write(PlanChange(max(rep.iteration, 0), got))
            self.events.emit("layout-adopted", epoch=self.epoch, plan=got.to_dict(),
                             reason=f"the trainers run {got.describe()} ({got.global_microbatches} micro-batches a "
                                    f"step); this coordinator was started with {was}: it takes the trainers' shares")
        elif got:
            log.error("coordinator: %s", got)
            self.metrics.inc("resihp_requests_invalid_total", 1, {"job": self.config.job, "kind": "layout"})
            self.events.emit("layout-mismatch", epoch=self.epoch, rank=rep.rank, reason=got)

    def _on_probe(self, pr: m.RankProbe, now: float) -> None:
        info = self.ranks[pr.rank]
        info.last_seen = now  # a probing spare is alive
        self.metrics.set("resihp_rank_probe_seconds", pr.probe_s, {"rank": pr.rank, "node": info.node,
                                                                   "job": self.config.job})
        try:
            found = self.engine.observe_probe(pr.rank, pr.probe_s, now)
        except ValueError as exc:
            self.metrics.inc("resihp_requests_invalid_total", 1, {"job": self.config.job, "kind": "probe"})
            log.warning("dropped probe of rank %d: %s", pr.rank, exc)
            return
        idle = not self.plan.has_rank(pr.rank)
        self.events.emit("probe", epoch=self.epoch, rank=pr.rank, probe_s=round(pr.probe_s, 6), idle=idle)
        self._findings(found, now)

    def _adopt(self, plan: Plan, first: int, now: float) -> None:
        """The engine (detector) judges iterations from ``first`` on by ``plan``."""
        self.engine.set_plan(plan, first)
        self.engine.observe(PlanChange(first, plan), now)
        self.engine_epoch = plan.epoch

    def _judgeable(self, rec: Any, built: int | None, now: float) -> bool:
        """Whether the engine's plan is the one ``rec`` was built with. A fail-stop recovery
        resumes at the last complete step, before the command's ``apply_at``, and its first
        records can come before the last ack: the pending plan is adopted from them. A record
        of a plan the engine no longer runs (or never will) is traced but not judged."""
        if built is None or built == self.engine_epoch:
            return True
        pend = self.pending
        if pend is not None and pend.adopted_at is None and built == pend.command.epoch:
            pend.adopted_at = rec.iteration
            self._adopt(pend.command.plan, rec.iteration, now)
            return True
        self.metrics.inc("resihp_records_unjudged_total", 1, {"job": self.config.job})
        log.info("iteration %d ran on epoch %d's plan, the detector is on epoch %d: traced, not judged",
                 rec.iteration, built, self.engine_epoch)
        return False

    def _on_record(self, rec: Any, now: float) -> None:
        self._progress_at = now  # the job makes progress (hang detection)
        built = self.joiner.epoch_of.pop(rec.iteration, None)  # the plan epoch the record was built with
        judge = self._judgeable(rec, built, now)
        if self.trace is not None:
            self.trace.write(rec, built)
        self.last_iteration = max(self.last_iteration, rec.iteration)
        self.metrics.set("resihp_iteration", rec.iteration, {"job": self.config.job})
        self.metrics.set("resihp_iteration_duration_seconds", rec.time_s, {"job": self.config.job})
        if rec.iteration % 10 == 0:
            self.journal.iteration(rec.iteration)
        if judge:
            self._findings(self.engine.observe(rec, now), now)
            self._update_suspects()
        audited = self.audits.observe(built if built is not None else self.engine_epoch, rec.iteration, rec.time_s)
        if audited is not None:
            self._on_audit(*audited, now)

    def _on_exit(self, ex: m.RankExit, now: float) -> None:
        info = self.ranks[ex.rank]
        if ex.pid and info.pid and ex.pid != info.pid:
            return  # an old process of a rank that has since restarted
        if ex.clean:
            info.finished = True
            self._live_cache = None
            self.journal.rank_state(ex.rank, "finished")
            self.events.emit("rank-finished", rank=ex.rank, node=info.node, reason=f"rank {ex.rank} left cleanly")
            if self.pending is not None:
                self.pending.awaiting.discard(ex.rank)
                self._maybe_acked(now)
            if all(i.finished or i.dead for i in self.ranks.values()):
                self.events.emit("job-finished", reason="every rank has left")
            return
        info.exit_code = ex.code
        self._fence_gone(ex.rank)
        if self.trace is not None:
            self.trace.write(ExitEvent(ex.rank, now, ex.code))
        found = self.engine.observe(ExitEvent(ex.rank, now, ex.code), now)
        if not any(f.kind == "fail-stop" and ex.rank in f.ranks for f in found):
            found.append(m.FindingInfo(self.last_iteration, "fail-stop", (ex.rank,), "process-exit", 1.0,
                                       f"rank {ex.rank} (pid {ex.pid}) {m.describe_exit(ex.code)} without leaving",
                                       now, **self._where(ex.rank)))
        self._findings(found, now)

    def _where(self, rank: int) -> dict[str, Any]:
        if not self.plan.has_rank(rank):
            return {}
        p = self.plan.position(rank)
        return {"stage": p.stage, "replica": p.replica}

    def _on_gpu(self, conn: AgentConn, g: m.GpuSample) -> None:
        record_gpu_sample(self.metrics, self.events, conn.node, self.config.job, g)

    # --- findings and plans -----------------------------------------------------------
    def _findings(self, found: list[m.FindingInfo], now: float) -> None:
        for f in found:
            fresh: list[int] = []
            if f.kind == "fail-stop":
                # a rank that left cleanly is finished, not failed, whatever the engine's clock says
                fresh = [r for r in f.ranks if not self.ranks[r].dead and not self.ranks[r].finished] if all(
                    0 <= r < self.config.world_size for r in f.ranks) else []
                if not fresh:
                    continue
                self._live_cache = None
                for r in fresh:
                    self.ranks[r].dead, self.ranks[r].dead_reason = True, f.reason
                    self.journal.rank_state(r, "dead", f.reason, self.ranks[r].pid)
                    self.metrics.set("resihp_rank_up", 0, {"rank": r, "node": self.ranks[r].node, "job": self.config.job})
                if self.pending is not None:
                    self.pending.awaiting.difference_update(fresh)
            self.last_finding = f
            gone, lasting = self.audits.forget(f)
            for regret_id in gone:
                self.journal.regret_over(regret_id)
            for regret in lasting:
                self.journal.regret(regret.to_json())
            self.metrics.inc("resihp_findings_total", 1, {"kind": f.kind, "job": self.config.job})
            self.events.emit("finding", epoch=self.epoch, **f.to_json())
            if fresh:
                self._fence(f, fresh)
            self._notify("finding", f)
            if not worth_acting(f, self.degraded_only):  # under the impact floor, or the end of such a slowdown
                continue
            observe_only = self.observe_only()
            if observe_only:  # reported, never acted on: no plan, no command, no abort
                self._observe(f, observe_only)
                continue
            # with re-planning off, a death outside the plan still needs every trainer to
            # shrink MPI past it (see _plan); the layout stays either way
            idle_death = f.kind == "fail-stop" and not any(self.plan.has_rank(r) for r in f.ranks)
            if self.policy["auto_reconfigure"] != "on" and not idle_death:
                continue
            if self.state in (State.RUNNING, State.SUSPECT):
                self._transition(Trigger.FINDING, f"{f.kind} on ranks {list(f.ranks)}: {f.reason}")
                self._plan(f, now, replan=self.policy["auto_reconfigure"] == "on")
            elif f.kind == "fail-stop" and self.state is State.RECONFIGURING and self._supersede(f, now):
                pass  # folded into the switch in flight (planning.py)
            elif self.state is not State.ABORTED:
                self.queued_findings.append(f)
        if self.pending is not None:
            self._maybe_acked(now)

    def _update_suspects(self) -> None:
        sus = [r for r, s in self.engine.suspects().items() if s == "suspect"]  # confirmed slow ranks are handled
        if sus and self.state is State.RUNNING:
            self._transition(Trigger.SUSPECTS, f"detector suspects ranks {sorted(sus)}")
        elif not sus and self.state is State.SUSPECT:
            self._transition(Trigger.CLEARED, "no suspect ranks left")

    def tick(self) -> None:
        with self.lock:
            now = self.now()
            found = self.engine.tick(now)
            unjudged = self._unjudged(now)  # ranks of a lost agent, in its grace
            found += [] if unjudged & set(self.plan.ranks()) else self._hung(now)
            found += self._silent(now, unjudged, found)
            self._findings(found, now)
            for rec in self.joiner.flush(now, self.live_set()):
                self._on_record(rec, now)
            if self.trace is not None:
                self.trace.flush(stale_s=TraceSink.FLUSH_S)
            pend = self.pending
            if pend is not None and now - pend.issued_at > float(self.policy["ack_timeout_s"]):
                self.pending = None
                self.plan = pend.command.plan
                if pend.adopted_at is None:
                    self._adopt(self.plan, pend.command.apply_at, now)
                self._transition(Trigger.ACK_TIMEOUT, f"ranks {sorted(pend.awaiting)} did not acknowledge epoch "
                                                      f"{pend.command.epoch} within {self.policy['ack_timeout_s']} s")
            self.metrics.set("resihp_epoch", self.epoch, {"job": self.config.job})
            for s in State:
                self.metrics.set("resihp_state", 1 if s is self.state else 0, {"state": s.value, "job": self.config.job})
