"""The hook-facing gRPC server of an agent, and the command relay behind it.

Binds to loopback or a unix socket only, and, when the agent holds the job token, answers
only calls that carry the ranks' credential (``auth.rank_token``, ``authorization: Bearer``
metadata; UNAUTHENTICATED otherwise): another local process cannot speak for a rank. An agent
started without a token (a test, a hand-run agent) serves its hooks openly and says so.

``CommandRelay`` keeps the recent commands so a hook that (re)subscribes with ``after_seq``
gets what it missed, and fans new ones out to the subscribed ranks they target.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import grpc.aio
from grpc_health.v1 import _async as aio_health  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's grpcio-health-checking stubs lack the asyncio servicer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from resihp.coordinator.model.trace import OpState
from resihp.coordinator.protocol import codec, wire
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.auth import AioTokenInterceptor, rank_token
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.protocol.decode_guard import add_servicer
from resihp.coordinator.service.server import SERVER_OPTIONS
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

log = logging.getLogger(__name__)
MAX_HOOK_BATCH = 4096


class HookSink(Protocol):
    """What the hook server needs from the daemon."""

    node: str
    job: str

    def hook_hello(self, rank: int, local_rank: int, pid: int, reshapes: bool = False,
                   model_json: str = "") -> None: ...
    def hook_reports(self, reports: list[tuple[int, int]], beats: list[tuple[int, int]],
                     raw: Sequence[pb.RankReport], ops: Mapping[int, OpState | None] | None = None) -> None: ...
    def hook_probes(self, probes: Sequence[m.RankProbe]) -> None: ...
    def hook_ack(self, ack: m.Ack) -> None: ...
    def hook_leave(self, rank: int, pid: int) -> None: ...
    def check_rank(self, rank: int) -> None: ...
    def coordinator_connected(self) -> bool: ...


def check_local_address(address: str) -> None:
    """Refuse any hook address that other machines could reach."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"hook address {address!r}: use 127.0.0.1:PORT, [::1]:PORT or unix:PATH") from None
    if not ip.is_loopback:
        raise ValueError(f"hook address {address!r} is not loopback; the hook API is for the node's own ranks, "
                         "so it binds to 127.0.0.1, ::1 or a unix socket only")
    if not port.isdigit():
        raise ValueError(f"hook address {address!r} needs a numeric port (0 = any free one)")


class _Putter(Protocol):
    def put(self, item: m.Command | None) -> None: ...


class CommandRelay:
    def __init__(self, keep: int = 256) -> None:
        self._lock = threading.Lock()
        self._recent: deque[m.Command] = deque(maxlen=keep)
        self._subs: dict[int, list[_Putter]] = {}
        self.last_seq = 0

    def publish(self, cmd: m.Command) -> None:
        with self._lock:
            if cmd.seq and any(c.seq == cmd.seq for c in self._recent):
                return  # re-sent after a coordinator restart; hooks already have it
            self._recent.append(cmd)
            self.last_seq = max(self.last_seq, cmd.seq)
            targets = [(r, qs) for r, qs in self._subs.items() if m.command_targets(cmd, r)]
        for _, qs in targets:
            for q in qs:
                q.put(cmd)

    def subscribe(self, rank: int, after_seq: int) -> tuple[queue.Queue[m.Command | None], list[m.Command]]:
        q: queue.Queue[m.Command | None] = queue.Queue()
        return q, self.subscribe_with(rank, after_seq, q)

    def subscribe_with(self, rank: int, after_seq: int, sink: _Putter) -> list[m.Command]:
        """Deliver future commands for ``rank`` to ``sink.put``; returns the missed ones."""
        with self._lock:
            self._subs.setdefault(rank, []).append(sink)
            return [c for c in self._recent if c.seq > after_seq and m.command_targets(c, rank)]

    def unsubscribe(self, rank: int, q: _Putter) -> None:
        with self._lock:
            if q in self._subs.get(rank, []):
                self._subs[rank].remove(q)

    def close(self) -> None:
        with self._lock:
            for qs in self._subs.values():
                for q in qs:
                    q.put(None)

    def subscribers(self) -> dict[int, int]:
        with self._lock:
            return {r: len(qs) for r, qs in self._subs.items() if qs}


class _AsyncQueueAdapter:
    """Lets the thread-side relay put into an asyncio queue owned by the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[m.Command | None] = asyncio.Queue()

    def put(self, item: m.Command | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class HookServicer(pbg.HookServicer):
    """asyncio handlers: one event-loop thread serves every hook (no per-message thread
    hand-offs, which dominated the agent's CPU with the thread-pool server)."""

    def __init__(self, sink: HookSink, relay: CommandRelay) -> None:
        self.sink = sink
        self.relay = relay

    async def _guard(self, context: grpc.aio.ServicerContext, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log.exception("hook call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return None

    async def Hello(self, request: pb.HookHello, context: grpc.aio.ServicerContext) -> pb.HookWelcome:
        def run() -> pb.HookWelcome:
            self.sink.check_rank(request.rank)
            if request.pid <= 0:
                raise ValidationError(f"hello.pid must be the trainer's process id (> 0), got {request.pid}")
            if request.local_rank < 0:  # the coordinator refuses it: the agent's uplink would be refused with it
                raise ValidationError(f"hello.local_rank must be >= 0, got {request.local_rank}")
            if request.job and request.job != self.sink.job:
                raise ValidationError(f"hello.job {request.job!r} does not match this agent's job {self.sink.job!r}")
            model_json = codec.check_model_json(request.model_json, "hello.model_json")
            self.sink.hook_hello(request.rank, request.local_rank, request.pid, request.reshapes, model_json)
            return pb.HookWelcome(node=self.sink.node, job=self.sink.job,
                                  coordinator_connected=self.sink.coordinator_connected())
        return await self._guard(context, run)  # type: ignore[return-value]

    def _accept(self, request: pb.HookReportBatch) -> int:
        reports, heartbeats, raw_probes = request.reports, request.heartbeats, request.probes
        if len(reports) + len(heartbeats) + len(raw_probes) > MAX_HOOK_BATCH:
            raise ValidationError(f"report batch holds more than {MAX_HOOK_BATCH} items; send smaller batches")
        check = wire.check_report  # packed or per-chunk form
        seen = [check(r, f"reports[{i}]") for i, r in enumerate(reports)]
        beats = [codec.check_heartbeat_pb(h, f"heartbeats[{i}]") for i, h in enumerate(heartbeats)]
        probes = [codec.probe_from_pb(p, f"probes[{i}]") for i, p in enumerate(raw_probes)]
        check_rank = self.sink.check_rank
        for rank, _ in seen:
            check_rank(rank)
        for rank, _ in beats:
            check_rank(rank)
        for p in probes:
            check_rank(p.rank)
        # the op each beating rank is in (hang localisation), validated like the rest
        ops = {h.rank: codec.heartbeat_op_from_pb(h, f"heartbeats[{i}]") for i, h in enumerate(heartbeats)}
        # validated: forwarded in wire form; the agent itself needs only (rank, iteration)
        self.sink.hook_reports(seen, beats, reports, ops)
        if probes:
            self.sink.hook_probes(probes)
        return len(seen) + len(beats) + len(probes)

    async def Report(self, request: pb.HookReportBatch, context: grpc.aio.ServicerContext) -> pb.HookReportReply:
        return await self._guard(context, lambda: pb.HookReportReply(accepted=self._accept(request)))  # type: ignore[return-value]

    async def ReportStream(self, request_iterator: AsyncIterator[pb.HookReportBatch],
                           context: grpc.aio.ServicerContext) -> pb.HookReportReply:
        total = 0
        async for request in request_iterator:
            try:  # inline, not through _guard: no coroutine per message
                total += self._accept(request)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:
                log.exception("hook report failed")
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return pb.HookReportReply(accepted=total)

    async def Commands(self, request: pb.CommandsRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.Command]:
        try:
            self.sink.check_rank(request.rank)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sub = _AsyncQueueAdapter(asyncio.get_running_loop())
        backlog = self.relay.subscribe_with(request.rank, request.after_seq, sub)
        try:
            for cmd in backlog:
                yield codec.command_to_pb(cmd)
            while True:
                item = await sub.queue.get()
                if item is None:
                    return
                yield codec.command_to_pb(item)
        finally:
            self.relay.unsubscribe(request.rank, sub)

    async def Acknowledge(self, request: pb.Ack, context: grpc.aio.ServicerContext) -> pb.Empty:
        def run() -> pb.Empty:
            ack = codec.ack_from_pb(request)
            self.sink.check_rank(ack.rank)
            self.sink.hook_ack(ack)
            return pb.Empty()
        return await self._guard(context, run)  # type: ignore[return-value]

    async def Leave(self, request: pb.Goodbye, context: grpc.aio.ServicerContext) -> pb.Empty:
        def run() -> pb.Empty:
            self.sink.check_rank(request.rank)
            self.sink.hook_leave(request.rank, request.pid)
            return pb.Empty()
        return await self._guard(context, run)  # type: ignore[return-value]


class HookServer:
    """The asyncio gRPC server, run on its own event-loop thread; start/stop are synchronous."""

    def __init__(self, sink: HookSink, relay: CommandRelay, address: str, job_token: str = "") -> None:
        """``job_token``: the job's token; hooks must then present ``rank_token(job_token)``."""
        check_local_address(address)
        interceptors = [AioTokenInterceptor(rank_token(job_token), "rank credential ($RESIHP_RANK_TOKEN)")
                        ] if job_token else []
        if not job_token:
            log.warning("the hook server at %s takes calls from any local process: the agent has no job token", address)
        self.relay = relay
        self._loop = asyncio.new_event_loop()
        self.loop = self._loop  # shared with the uplink
        self._thread = threading.Thread(target=self._loop.run_forever, name="hook-server", daemon=True)
        self._thread.start()
        self.address = address
        self._servicer = HookServicer(sink, relay)

        async def build() -> tuple[grpc.aio.Server, Any, int]:
            server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
            add_servicer(pbg.add_HookServicer_to_server, self._servicer, server, aio=True)
            health_servicer = aio_health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            name = pb.DESCRIPTOR.services_by_name["Hook"].full_name
            for svc in (name, ""):
                await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
            reflection.enable_server_reflection(
                [name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
            port = server.add_insecure_port(address)
            return server, health_servicer, port

        self.server, self.health, port = self._run(build())
        if port == 0 and not address.startswith("unix"):
            self.stop_loop()
            raise OSError(f"could not bind the hook server to {address}")
        self.address = address if address.startswith("unix") else f"{address.rpartition(':')[0]}:{port}"

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> None:
        self._run(self.server.start())

    def stop(self, grace_s: float = 0.5) -> None:
        self.relay.close()
        try:
            self._run(self.health.enter_graceful_shutdown())
            self._run(self.server.stop(grace_s), timeout=grace_s + 5)
        finally:
            self.stop_loop()

    def stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
