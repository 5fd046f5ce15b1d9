"""The agent's link to the coordinator: register, then one bidirectional stream.

Outgoing items wait in a bounded buffer (oldest dropped first, counted) while the
coordinator is away; the link reconnects with exponential backoff and jitter and
re-registers, so a restarted coordinator sees the agent again within about a second.
Items merge into one stream message per wake-up, after a short linger that lets a burst
of reports from ranks stepping together travel as one (hooks flush on a shared wall-clock
grid, so a node's ranks arrive together); exits and acks skip the linger.

It runs on an asyncio event loop — the hook server's, when the daemon passes it — so a
report travels hook → agent → coordinator without a thread hand-off; ``send`` may be
called from any thread.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.auth import metadata
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

log = logging.getLogger(__name__)
LIST_FIELDS = ("reports", "acks", "exits", "gpus", "processes", "joined", "injections", "raw_reports", "probes")


class Uplink:
    def __init__(self, target: str, token: str, registration: Callable[[], m.Registration],
                 on_batch: Callable[[m.CoordinatorBatch], None], on_welcome: Callable[[m.Welcome], None],
                 tls_ca: str | None = None, buffer_items: int = 10000, linger_s: float = 0.02,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 1.0,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.target = target
        self.token = token
        self.registration = registration
        self.on_batch = on_batch
        self.on_welcome = on_welcome
        self.tls_ca = tls_ca
        self.linger_s = linger_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._buf: deque[m.AgentBatch] = deque()
        self._urgent = False
        self._cap = buffer_items
        self._lock = threading.Lock()
        self.dropped = 0
        self.connected = threading.Event()
        self.agent_id = ""
        self.connects = 0
        self.last_error = ""
        self._own_loop = loop is None
        self._loop = loop or asyncio.new_event_loop()
        self._loop_thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Future[Any] | None = None
        self._stopping = False
        self._loop_ident = -1  # the event loop's thread: sends from it skip the self-pipe

    # --- any thread ---------------------------------------------------------------------
    def start(self) -> None:
        if self._own_loop:
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="uplink", daemon=True)
            self._loop_thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._loop)  # type: ignore[assignment]

    def send(self, batch: m.AgentBatch, urgent: bool = False) -> None:
        with self._lock:
            if len(self._buf) >= self._cap:
                self._buf.popleft()
                self.dropped += 1
            self._buf.append(batch)
            first = len(self._buf) == 1
            self._urgent = self._urgent or urgent
        if (first or urgent) and self._wake is not None:  # wake the sender only when there is news
            if threading.get_ident() == self._loop_ident:
                self._wake.set()  # a hook handler on our own loop: no self-pipe write and wake-up
            else:
                self._loop.call_soon_threadsafe(self._wake.set)

    def pending(self) -> int:
        with self._lock:
            return len(self._buf)

    def close(self, timeout: float = 2.0) -> None:
        self._stopping = True
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
            try:
                self._task.result(timeout)  # type: ignore[union-attr]
            except BaseException:  # cancelled, or the loop is already gone
                pass
        if self._own_loop:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout)

    # --- the event loop -----------------------------------------------------------------
    def _take(self) -> m.AgentBatch:
        with self._lock:
            items = list(self._buf)
            self._buf.clear()
            self._urgent = False
        merged: dict[str, list[object]] = {f: [] for f in LIST_FIELDS}
        heartbeat = None
        for b in items:
            for f in LIST_FIELDS:
                merged[f].extend(getattr(b, f))
            heartbeat = b.heartbeat or heartbeat
        return m.AgentBatch(agent_id=self.agent_id, heartbeat=heartbeat,
                            **{f: tuple(v) for f, v in merged.items()})  # type: ignore[arg-type]

    async def _writer(self, call: Any) -> None:
        assert self._wake is not None
        await call.write(codec.agent_batch_to_pb(m.AgentBatch(agent_id=self.agent_id)))
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._urgent:
                await asyncio.sleep(self.linger_s)  # let the rest of a step's burst arrive
            batch = self._take()
            if any(getattr(batch, f) for f in LIST_FIELDS) or batch.heartbeat is not None:
                await call.write(codec.agent_batch_to_pb(batch))

    def _channel(self) -> grpc.aio.Channel:
        opts = [("grpc.keepalive_time_ms", 10000)]
        if self.tls_ca:
            with open(self.tls_ca, "rb") as fh:
                creds = grpc.ssl_channel_credentials(root_certificates=fh.read())
            return grpc.aio.secure_channel(self.target, creds, options=opts)
        return grpc.aio.insecure_channel(self.target, options=opts)

    async def _main(self) -> None:
        self._loop_ident = threading.get_ident()
        self._wake = asyncio.Event()
        if self.pending():
            self._wake.set()
        backoff = self.backoff_initial_s
        md = metadata(self.token)
        while not self._stopping:
            chan = self._channel()
            writer: asyncio.Task[None] | None = None
            try:
                stub = pbg.CoordinatorStub(chan)
                reply = await stub.Register(codec.registration_to_pb(self.registration()), metadata=md, timeout=5)
                welcome = codec.welcome_from_pb(reply)
                self.agent_id = welcome.agent_id
                self.on_welcome(welcome)
                call = stub.Stream(metadata=md)
                writer = asyncio.ensure_future(self._writer(call))
                self.connects += 1
                self.connected.set()
                if self.last_error:
                    log.info("uplink to %s restored", self.target)
                self.last_error = ""
                backoff = self.backoff_initial_s
                self._wake.set()  # flush what was buffered while away
                async for msg in _messages(call):
                    self.on_batch(codec.coordinator_batch_from_pb(msg))
                reason = "coordinator closed the stream"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code()}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    reason += " (check RESIHP_TOKEN)"
            except codec.ValidationError as exc:
                reason = f"bad message from the coordinator: {exc}"
            except asyncio.CancelledError:
                reason = "closed"
                self._stopping = True
            finally:
                self.connected.clear()
                if writer is not None:
                    writer.cancel()
                await chan.close()
            if self._stopping:
                break
            if reason != self.last_error:
                log.warning("uplink to %s down (%s); retrying with backoff", self.target, reason)
            self.last_error = reason
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.backoff_max_s)


async def _messages(call: Any) -> AsyncIterator[pb.CoordinatorMessage]:
    async for msg in call:
        yield msg
