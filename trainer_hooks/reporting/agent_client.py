"""The trainer side of the hook ↔ agent protocol.

``report()`` never blocks a training step: it appends to a bounded queue that a
background thread drains to the node's agent (batched, one RPC per wake-up); when the
queue is full the report is dropped and counted. Commands from the coordinator arrive on
a second background thread and are handed to ``on_command`` and kept for
``poll_commands()``; the runtime applies them at ``apply_at`` and calls ``ack()``. A
command re-delivered after a coordinator restart is re-acknowledged automatically.
When no agent is reachable, training goes on: one warning, then quiet retries.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import grpc

from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import codec, wire
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.auth import metadata, rank_token_from_env
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.reporting.notices import NoticeHandler, exit_on_peer_failure_default
from resihp.trainer_hooks.reporting.opcursor import CURSOR

log = logging.getLogger(__name__)
CommandCallback = Callable[[m.Command], None]
NoticeCallback = Callable[[m.NoticeCommand], None]


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        if os.environ.get(name, "").strip().lstrip("-").isdigit():
            return int(os.environ[name])
    return default


def agent_address_from_env(rank: int) -> str:
    """RESIHP_AGENT_ADDR, else this rank's entry of RESIHP_AGENT_ADDRS (one per node, ranks in
    blocks of RESIHP_RANKS_PER_NODE, as ``resihp launch`` sets them); "" if neither is set."""
    if os.environ.get("RESIHP_AGENT_ADDR"):
        return os.environ["RESIHP_AGENT_ADDR"]
    addrs = [a for a in os.environ.get("RESIHP_AGENT_ADDRS", "").split(",") if a]
    if not addrs:
        return ""
    per_node = max(1, _env_int("RESIHP_RANKS_PER_NODE", default=1))
    return addrs[min(rank // per_node, len(addrs) - 1)]


class AgentClient:
    """One per trainer process. Thread-safe; ``report`` and ``ack`` are cheap and never raise
    because of the network."""

    def __init__(self, rank: int, address: str | None, local_rank: int = 0, job: str = "",
                 on_command: CommandCallback | None = None, queue_size: int = 1024, heartbeat_s: float = 1.0,
                 flush_s: float = 0.25, connect_timeout_s: float = 2.0, retry_s: float = 2.0,
                 clock: Callable[[], float] = time.time, urgent_factor: float = 1.3, *, reshapes: bool = False,
                 model_json: str = "", on_notice: NoticeCallback | None = None,
                 exit_on_peer_failure: bool | None = None, credential: str | None = None) -> None:
        """``reshapes``: this rank's runtime applies a ReconfigCommand (live reconfiguration is
        installed); False = the job is only observed. ``model_json``: the ModelSpec it trains, as
        JSON. ``on_notice``: replaces the default notice handler. ``exit_on_peer_failure``: end
        this process (code 75) when a peer dies; None = $RESIHP_EXIT_ON_PEER_FAILURE, else on
        exactly when the rank does not reshape (docs/control-plane.md, "Observe-only jobs").
        ``credential``: the ranks' credential the agent asks for (default: ``$RESIHP_RANK_TOKEN``,
        else derived from ``$RESIHP_TOKEN``; none where neither is set)."""
        self.rank = rank
        self.local_rank = local_rank
        self.address = address or ""
        self.job = job
        self.on_command = on_command
        self.reshapes = reshapes
        self.model_json = model_json
        self.exit_on_peer_failure = (exit_on_peer_failure_default(reshapes) if exit_on_peer_failure is None
                                     else exit_on_peer_failure)
        self.on_notice: NoticeCallback = on_notice or NoticeHandler(rank, self.exit_on_peer_failure)
        self.notices: list[m.NoticeCommand] = []  # every notice received, oldest first
        self._noticed: set[int] = set()  # seqs already handed to on_notice
        self.queue_size = queue_size
        self.heartbeat_s = heartbeat_s
        # Reports leave in batches on a wall-clock grid of flush_s (0.25 s: about one iteration
        # of a 0.235 s CPU step; one stream message per batch, packed by protocol.wire). A longer
        # flush cuts the rank's and the agent's CPU (measured: 1 s took their share from ~1.8 to
        # ~0.45 ms per iteration) but a slowdown that does not show in step_s then reaches the
        # detector up to flush_s later; a slow step (> urgent_factor × typical) and acks go at once.
        self.flush_s = flush_s
        self.urgent_factor = urgent_factor
        self._typical_step = 0.0  # moving average of step_s: a much slower step is sent at once
        self._hurry = threading.Event()  # cuts the flush wait short: slow step, ack, close
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self.epoch = 0
        self.iteration = -1
        self.dropped = 0
        self.sent = 0
        self.connected = threading.Event()
        self._reports: deque[m.RankReport] = deque()
        self._acks: deque[m.Ack] = deque()
        self._probes: deque[m.RankProbe] = deque(maxlen=64)  # rare (start-up, idle ranks); oldest dropped
        self._wake = threading.Event()
        self._drained = threading.Event()  # the send loop found both queues empty (close waits on it)
        self._stop = threading.Event()
        self._commands: deque[m.Command] = deque(maxlen=256)
        self._acked: dict[int, m.Ack] = {}  # seq -> our ack, to answer re-deliveries
        self._last_seq = 0
        self._warned = False
        self._md = metadata(rank_token_from_env() if credential is None else credential)  # on every call
        self._channel: grpc.Channel | None = None
        self._stub: pbg.HookStub | None = None
        self._threads: list[threading.Thread] = []
        self._cmd_call: object | None = None
        self._generation = 0  # the live report stream; an older generator stops when it changes

    @classmethod
    def from_env(cls, on_command: CommandCallback | None = None, **kwargs: object) -> AgentClient:
        """Rank and addresses as ``resihp launch`` / mpirun set them."""
        rank = _env_int("RESIHP_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")
        local = _env_int("RESIHP_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
        return cls(rank, agent_address_from_env(rank), local, os.environ.get("RESIHP_JOB", ""),
                   on_command, **kwargs)  # type: ignore[arg-type]

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> AgentClient:
        if not self.address:
            self._warn("RESIHP_AGENT_ADDR is not set")
            return self
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pbg.HookStub(self._channel)
        self._hello()
        for target, name in ((self._send_loop, "resihp-report"), (self._command_loop, "resihp-commands")):
            t = threading.Thread(target=target, name=f"{name}-{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("resihp: rank %d cannot reach its node agent at %s (%s); training continues without "
                        "resilience reporting and keeps retrying quietly", self.rank, self.address or "-", why)

    def _hello(self) -> bool:
        if self._stub is None:
            return False
        try:
            self._stub.Hello(pb.HookHello(rank=self.rank, local_rank=self.local_rank, pid=os.getpid(), job=self.job,
                                          reshapes=self.reshapes, model_json=self.model_json),
                             timeout=self.connect_timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            self.connected.clear()
            self._warn(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
            return False
        if self._warned:
            log.info("resihp: rank %d reached its agent at %s", self.rank, self.address)
        self.connected.set()
        return True

    def close(self, clean: bool = True, timeout: float = 2.0) -> None:
        """Flush what is queued, say goodbye (a clean exit is not a failure), stop the threads."""
        if self._stub is not None and self.connected.is_set():
            deadline = time.monotonic() + timeout
            while (self._reports or self._acks) and time.monotonic() < deadline:
                self._drained.clear()
                if not (self._reports or self._acks):
                    break
                self._wake.set()
                self._hurry.set()
                self._drained.wait(deadline - time.monotonic())  # set by the send loop when both are empty
            if clean:
                try:
                    self._stub.Leave(pb.Goodbye(rank=self.rank, pid=os.getpid()), timeout=timeout, metadata=self._md)
                except grpc.RpcError:
                    pass
        self._stop.set()
        self._wake.set()
        self._hurry.set()
        call = self._cmd_call
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]
        for t in self._threads:
            t.join(timeout)
        if self._channel is not None:
            self._channel.close()

    # --- the step-side API ------------------------------------------------------------
    def report(self, iteration: int, step_s: float, start_s: float | None = None,
               seqlens: Sequence[Sequence[int]] = (), chunks: Sequence[ChunkTiming] = (),
               epoch: int | None = None) -> bool:
        """Queue one finished iteration; returns False if it was dropped (queue full)."""
        self.iteration = iteration
        if len(self._reports) >= self.queue_size:
            self.dropped += 1
            if self.connected.is_set():
                return False
            self._reports.popleft()  # agent away (restarting): keep the newest for the replay
        typical = self._typical_step
        if typical > 0 and step_s > typical * self.urgent_factor:
            self._hurry.set()  # a slow step is news: skip the flush wait (see _linger)
        self._typical_step = step_s if typical <= 0 else typical + 0.1 * (step_s - typical)
        self._reports.append(m.RankReport(
            self.rank, self.epoch if epoch is None else epoch, iteration,
            self.clock() - step_s if start_s is None else start_s, step_s,
            tuple(map(tuple, seqlens)), tuple(chunks)))  # type: ignore[arg-type]
        if not self._wake.is_set():
            self._wake.set()
        return True

    def probe(self, probe_s: float) -> None:
        """Queue this rank's compute probe (``trainer_hooks/runtime/probe.py``); sent with the next batch."""
        self._probes.append(m.RankProbe(self.rank, self.clock(), probe_s))
        self._wake.set()

    def poll_commands(self) -> list[m.Command]:
        """Commands received since the last call, oldest first."""
        out = []
        while self._commands:
            out.append(self._commands.popleft())
        return out

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        """Acknowledge that ``command`` was applied at ``iteration`` (or failed: ok=False + error)."""
        a = m.Ack(self.rank, command.seq, command.epoch, max(iteration, 0), ok, error, self.clock())
        self._acked[command.seq] = a
        if ok and isinstance(command, m.ReconfigCommand):
            self.epoch = max(self.epoch, command.epoch)
        self._acks.append(a)
        self._wake.set()
        self._hurry.set()

    # --- background threads -------------------------------------------------------------
    def _send_loop(self) -> None:
        """Keep one ReportStream open to the agent; reopen it (quietly) when it breaks."""
        while not self._stop.is_set():
            if not self.connected.is_set() and not self._hello():
                # the bounded queue is kept (oldest dropped first): a restarted agent gets it replayed
                self._stop.wait(self.retry_s)
                continue
            self._generation += 1
            try:
                assert self._stub is not None
                self._stub.ReportStream(self._batches(self._generation), metadata=self._md)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # type: ignore[attr-defined]
                    log.error("resihp: agent refused a report from rank %d: %s", self.rank,
                              exc.details())  # type: ignore[attr-defined]
                    continue
                if self._stop.is_set():
                    return
                self.connected.clear()
                self._warn(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]

    def _batches(self, generation: int) -> Iterator[pb.HookReportBatch]:
        """The stream's messages: queued reports (and acks, sent beside it), plus a heartbeat at
        least every ``heartbeat_s``; ends once the client is closed and the queue is empty."""
        last_sent = 0.0
        while generation == self._generation:
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._acks:
                try:
                    self._flush_acks()
                except grpc.RpcError:
                    pass  # kept queued; retried on the next wake-up
            batch: list[m.RankReport] = []
            while self._reports and len(batch) < 512:
                batch.append(self._reports.popleft())
            probes = []
            while self._probes:
                probes.append(self._probes.popleft())
            now = self.clock()
            if batch or probes or now - last_sent >= self.heartbeat_s:
                # packed reports: a few array copies instead of a message per chunk (protocol.wire)
                seq, kind, name, done = CURSOR.snapshot()  # the op this rank is in (hang localisation)
                beat = pb.RankHeartbeat(rank=self.rank, time_s=now, iteration=self.iteration, op_kind=kind,
                                        op_name=name, op_done=done, op_seq=seq)
                yield wire.report_batch(batch, [beat], probes)
                self.sent += len(batch)
                last_sent = now
            if self._reports or self._acks or self._probes:
                self._wake.set()
                continue
            self._drained.set()
            if self._stop.is_set():
                return
            elif self.flush_s > 0:
                self._linger(self.clock())

    def _linger(self, now: float) -> None:
        """Wait for the next multiple of ``flush_s`` on the wall clock (the same instants for
        every rank of the node, so the agent forwards one merged message per tick instead of
        one per rank), unless a slow step, an ack or close cuts the wait short."""
        self._hurry.wait(self.flush_s - now % self.flush_s)
        self._hurry.clear()

    def _flush_acks(self) -> None:
        while self._acks:
            a = self._acks[0]
            assert self._stub is not None
            self._stub.Acknowledge(codec.ack_to_pb(a), timeout=5, metadata=self._md)
            self._acks.popleft()

    def _command_loop(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            if self._stub is None:
                return
            try:
                call = self._stub.Commands(pb.CommandsRequest(rank=self.rank, after_seq=self._last_seq), metadata=self._md)
                self._cmd_call = call
                for msg in call:
                    backoff = 0.05
                    try:
                        cmd = codec.command_from_pb(msg)
                    except codec.ValidationError as exc:
                        log.error("resihp: rank %d got a malformed command: %s", self.rank, exc)
                        continue
                    self._deliver(cmd)
            except grpc.RpcError:
                pass
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)

    def _deliver(self, cmd: m.Command) -> None:
        self._last_seq = max(self._last_seq, cmd.seq)
        if isinstance(cmd, m.NoticeCommand):  # information: handed on once, never applied nor acknowledged
            if cmd.seq in self._noticed:
                return
            self._noticed.add(cmd.seq)
            self.notices.append(cmd)
            try:
                self.on_notice(cmd)
            except Exception:
                log.exception("resihp: on_notice failed for notice %d", cmd.seq)
            return
        prior = self._acked.get(cmd.seq)
        if prior is not None:  # re-sent after a coordinator restart: we already applied it
            self._acks.append(prior)
            self._wake.set()
            self._hurry.set()
            return
        self._commands.append(cmd)
        DEATHS.note(cmd)  # heard now, even while the main thread is blocked in a switch
        if self.on_command is not None:
            try:
                self.on_command(cmd)
            except Exception:
                log.exception("resihp: on_command callback failed for command %d", cmd.seq)
