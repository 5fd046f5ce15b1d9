"""The node agent: hook server + pid watch + samplers + uplink + command relay, wired.

One per node. It outlives a crashed trainer, notices a local rank's exit at once, sends
heartbeats (with the last time each local rank was heard from) every
``heartbeat_interval_s`` and GPU / process samples every ``sample_interval_s``, relays
commands to hooks and carries out the coordinator's kill orders (fault injection, and the
fence of a rank declared dead while its process may still live).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from resihp.agent.fence_pid import is_job_process, sigkill
from resihp.agent.pidwatch import PidWatch
from resihp.agent.sampler import ProcessSampler, Sampler, make_sampler
from resihp.agent.server import CommandRelay, HookServer
from resihp.agent.uplink import Uplink
from resihp.coordinator.model.trace import OpState
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import MAX_RANK, ValidationError

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    node: str = field(default_factory=socket.gethostname)
    job: str = "job"
    coordinator: str = "127.0.0.1:0"  # host:port of the coordinator
    token: str = ""
    tls_ca: str = ""
    hook_address: str = "127.0.0.1:0"  # loopback or unix:PATH only
    run_dir: str = ""  # where agent-<node>.json (the bound hook address) is written
    world_size: int = 0  # 0 = unknown: ranks are checked against MAX_RANK only
    sample_interval_s: float = 1.0
    heartbeat_interval_s: float = 0.5
    gpu_sampler: str = "nvml"  # nvml | off | fake
    nvml_deadline_s: float = 2.0
    buffer_items: int = 10000
    exit_when_ranks_done: bool = False  # stop once every rank that said hello has exited
    # CPU niceness added at start (0..19): the agent then runs in the ranks' idle time (pipeline
    # bubbles, communication waits) instead of preempting a training rank on a busy node
    nice: int = 0

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("agent needs a node name")
        for name in ("sample_interval_s", "heartbeat_interval_s", "nvml_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be 0..19 (added niceness; 0 = unchanged), got {self.nice}")
        if self.buffer_items < 16:
            raise ValueError(f"buffer_items must be >= 16, got {self.buffer_items}")


@dataclass
class _Local:
    rank: int
    local_rank: int
    pid: int
    last_seen: float
    iteration: int = -1
    op: OpState | None = None  # the op its latest heartbeat named (hang localisation)
    said_goodbye: bool = False
    exited: bool = False
    reshapes: bool = False  # its hello: the runtime applies a ReconfigCommand
    model_json: str = ""  # its hello: the ModelSpec it trains

    def joined(self) -> m.LocalRank:
        return m.LocalRank(self.rank, self.local_rank, self.pid, self.reshapes, self.model_json)


class AgentDaemon:
    def __init__(self, cfg: AgentConfig, sampler: Sampler | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.node, self.job = cfg.node, cfg.job
        self.clock = clock
        self.sampler = sampler or make_sampler(cfg.gpu_sampler, cfg.nvml_deadline_s)
        self.procs = ProcessSampler()
        self._lock = threading.Lock()
        self.locals: dict[int, _Local] = {}
        self.relay = CommandRelay()
        self.pidwatch = PidWatch(self._on_exit)
        self.hook_server = HookServer(self, self.relay, cfg.hook_address, job_token=cfg.token)
        self.uplink = Uplink(cfg.coordinator, cfg.token, self._registration, self._on_coordinator,
                             self._on_welcome, tls_ca=cfg.tls_ca or None, buffer_items=cfg.buffer_items,
                             loop=self.hook_server.loop)  # one event loop for hooks and uplink
        self.stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="agent-tick", daemon=True)
        self.kills: list[int] = []
        self.on_command: Callable[[m.Command], None] | None = None  # observers (tests, bench)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.nice:
            os.nice(self.cfg.nice)  # the whole process: every thread started after this inherits it
        self.hook_server.start()
        self.uplink.start()
        self._ticker.start()
        if self.cfg.run_dir:
            info = {"node": self.node, "hook": self.hook_server.address, "pid": os.getpid(), "job": self.job}
            path = Path(self.cfg.run_dir) / f"agent-{self.node}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(path)
        degraded, status = self.sampler.status()
        log.info("agent %s: hooks on %s, coordinator %s, GPU sampler %s", self.node, self.hook_server.address,
                 self.cfg.coordinator, status)

    def stop(self) -> None:
        self.stopped.set()
        self.relay.close()
        self.uplink.close()
        self.hook_server.stop()
        self.pidwatch.close()
        self.sampler.close()
        self._ticker.join(timeout=2)

    # --- hook side ------------------------------------------------------------------------
    def check_rank(self, rank: int) -> None:
        limit = self.cfg.world_size - 1 if self.cfg.world_size else MAX_RANK
        if not 0 <= rank <= limit:
            raise ValidationError(f"rank {rank} is out of range; this job has ranks 0..{limit}")

    def coordinator_connected(self) -> bool:
        return self.uplink.connected.is_set()

    def hook_hello(self, rank: int, local_rank: int, pid: int, reshapes: bool = False, model_json: str = "") -> None:
        with self._lock:
            old = self.locals.get(rank)
            if old is not None and old.pid == pid and not old.exited and (old.reshapes, old.model_json) == (
                    reshapes, model_json):
                old.last_seen = self.clock()
                return
            loc = self.locals[rank] = _Local(rank, local_rank, pid, self.clock(), reshapes=reshapes,
                                             model_json=model_json)
        self.pidwatch.watch(rank, pid)
        log.info("rank %d (pid %d) joined on %s (%s)", rank, pid, self.node,
                 "reshapes" if reshapes else "observe-only: no live reconfiguration")
        self.uplink.send(m.AgentBatch(joined=(loc.joined(),)), urgent=True)

    def hook_reports(self, reports: list[tuple[int, int]], beats: list[tuple[int, int]],
                     raw: Sequence[object], ops: Mapping[int, OpState | None] | None = None) -> None:
        """``reports`` and ``beats``: (rank, iteration) of validated reports and heartbeats;
        ``raw``: the reports in wire form, forwarded as they are (no re-encoding); ``ops``: the
        op each beating rank named (None: it names none), passed on with the agent's beats."""
        now = self.clock()
        with self._lock:
            for rank, iteration in (*reports, *beats):
                loc = self.locals.get(rank)
                if loc is not None:
                    loc.last_seen = now
                    if iteration > loc.iteration:
                        loc.iteration = iteration
            for rank, op in (ops or {}).items():
                loc = self.locals.get(rank)
                if loc is not None:
                    loc.op = op
        if raw:
            self.uplink.send(m.AgentBatch(raw_reports=tuple(raw)))

    def hook_probes(self, probes: Sequence[m.RankProbe]) -> None:
        """Idle ranks' compute probes, validated: on to the coordinator's detector."""
        now = self.clock()
        with self._lock:
            for p in probes:
                loc = self.locals.get(p.rank)
                if loc is not None:
                    loc.last_seen = now
        self.uplink.send(m.AgentBatch(probes=tuple(probes)))

    def hook_ack(self, ack: m.Ack) -> None:
        self.uplink.send(m.AgentBatch(acks=(ack,)), urgent=True)

    def hook_leave(self, rank: int, pid: int) -> None:
        # A goodbye ends the rank's part in the job at once: its process may still linger
        # (Open MPI's finalisation can hang), and it must not then be taken for a hung rank.
        with self._lock:
            loc = self.locals.get(rank)
            if loc is None or (pid and loc.pid != pid) or loc.said_goodbye:
                return
            loc.said_goodbye = True
            loc_pid = loc.pid
        log.info("rank %d (pid %d) said goodbye", rank, loc_pid)
        self.uplink.send(m.AgentBatch(exits=(m.RankExit(rank, loc_pid, self.clock(), 0, True),)), urgent=True)

    # --- exits ----------------------------------------------------------------------------
    def _on_exit(self, rank: int, pid: int, code: int) -> None:
        with self._lock:
            loc = self.locals.get(rank)
            if loc is None or loc.pid != pid:
                return
            loc.exited = True
            clean = loc.said_goodbye
            if code == m.EXIT_UNKNOWN and rank in self.kills:  # our own SIGKILL (fault injection): we know the cause
                code = -signal.SIGKILL
        log.log(logging.INFO if clean else logging.WARNING, "rank %d (pid %d) exited%s, code %d", rank, pid,
                " cleanly" if clean else " WITHOUT saying goodbye", code)
        self.procs.forget([pid])
        if not clean:  # a clean leave was reported when the rank said goodbye
            self.uplink.send(m.AgentBatch(exits=(m.RankExit(rank, pid, self.clock(), code, clean),)), urgent=True)
        if self.cfg.exit_when_ranks_done:
            with self._lock:
                done = bool(self.locals) and all(loc.exited for loc in self.locals.values())
            if done:
                threading.Thread(target=self._flush_and_stop, daemon=True).start()

    def _flush_and_stop(self) -> None:
        deadline = time.monotonic() + 2.0
        while self.uplink.pending() and time.monotonic() < deadline and self.uplink.connected.is_set():
            self.stopped.wait(0.05)
        self.stopped.set()

    # --- coordinator side -------------------------------------------------------------------
    def _registration(self) -> m.Registration:
        degraded, status = self.sampler.status()
        with self._lock:
            ranks = tuple(loc.joined() for loc in self.locals.values() if not loc.exited)
        return m.Registration(self.node, self.job, ranks, socket.gethostname(), degraded, status)

    def _on_welcome(self, welcome: m.Welcome) -> None:
        log.info("registered with the coordinator as %s (epoch %d)", welcome.agent_id, welcome.epoch)

    def _on_coordinator(self, batch: m.CoordinatorBatch) -> None:
        for cmd in batch.commands:
            self.relay.publish(cmd)
            if self.on_command is not None:
                self.on_command(cmd)
        for kill in batch.kills:
            self._kill(kill)

    def _kill(self, order: m.KillOrder) -> None:
        if order.fence:
            self._fence(order)
            return
        with self._lock:
            loc = self.locals.get(order.rank)
        if loc is None or loc.exited:
            result = m.InjectResult("kill", order.rank, False, f"rank {order.rank} is not running on {self.node}")
        else:
            try:
                os.kill(loc.pid, signal.SIGKILL)
                self.kills.append(order.rank)
                result = m.InjectResult("kill", order.rank, True, f"SIGKILL sent to pid {loc.pid} on {self.node}")
            except OSError as exc:
                result = m.InjectResult("kill", order.rank, False, f"kill of pid {loc.pid} failed: {exc}")
        log.warning("inject kill: %s", result.detail)
        self.uplink.send(m.AgentBatch(injections=(result,)), urgent=True)

    def _fence(self, order: m.KillOrder) -> None:
        """A rank declared dead while its process may still live (stopped, stuck, a frozen
        host): SIGKILL it, so its peers' collectives and MPI's shrink stop waiting for it and
        it can never wake up into a job that has moved on. An agent restarted since the
        verdict has not met the process: it kills the pid the coordinator names, if that
        process belongs to this job (a pid may have been reused)."""
        with self._lock:
            loc = self.locals.get(order.rank)
            pid = loc.pid if loc is not None and not loc.exited else 0
            if loc is None and order.pid > 0 and is_job_process(order.pid, self.job):
                pid = order.pid
            if pid:
                self.kills.append(order.rank)
        if not pid:
            result = m.InjectResult("fence", order.rank, True,
                                    f"rank {order.rank} has no live process of job {self.job} on {self.node}")
        else:
            result = m.InjectResult("fence", order.rank, *sigkill(pid, self.node))
        log.warning("fence rank %d (%s): %s", order.rank, order.reason, result.detail)
        self.uplink.send(m.AgentBatch(injections=(result,)), urgent=True)

    # --- periodic -----------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        next_sample = 0.0
        every = self.cfg.heartbeat_interval_s
        # Ticks fall on multiples of the interval on the wall clock, where the hooks' flush
        # ticks fall too, so a heartbeat shares its uplink message with the ranks' reports.
        while not self.stopped.wait(_to_next_tick(every)):
            now = self.clock()
            try:
                with self._lock:
                    beats = tuple(m.RankHeartbeat(loc.rank, loc.last_seen, loc.iteration, loc.op)
                                  for loc in self.locals.values() if not loc.exited)
                    pids = {loc.rank: loc.pid for loc in self.locals.values() if not loc.exited}
                degraded, status = self.sampler.status()
                batch = m.AgentBatch(heartbeat=m.AgentHeartbeat(now, beats, degraded, status))
                if now >= next_sample:
                    next_sample = now + self.cfg.sample_interval_s
                    gpus = tuple(self.sampler.sample(now))
                    procs = tuple(self.procs.sample(pids, now))
                    batch = m.AgentBatch(heartbeat=batch.heartbeat, gpus=gpus, processes=procs)
                self.uplink.send(batch)
            except Exception:  # sampling must never take the agent down
                log.exception("agent tick failed")


def _to_next_tick(every: float) -> float:
    """Seconds to the next multiple of ``every`` on the wall clock; a wait that ended a hair
    early must not tick twice, so a tick closer than a tenth of the interval is skipped."""
    left = every - time.time() % every
    return left + every if left < 0.1 * every else left
