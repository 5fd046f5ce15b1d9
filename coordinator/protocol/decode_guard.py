"""Requests whose bytes do not parse answer INVALID_ARGUMENT, not INTERNAL.

gRPC Python decodes a request before any handler runs; when protobuf refuses the bytes
(a truncated message, a corrupt wire type, invalid UTF-8 in a string) the sync server
answers INTERNAL "Exception deserializing request!" and the asyncio one UNKNOWN. Both say
"the server is broken" about what is the client's fault. ``add_servicer`` registers a
generated servicer with deserializers that never raise: a request that does not decode
becomes an ``Undecodable`` and its call is aborted with INVALID_ARGUMENT naming the message
type. For a client stream the abort comes when the bad message is reached, so the ones
before it were handled as usual.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

Behavior = Callable[..., Any]


class Undecodable:
    """What a request that protobuf refused decodes to: the reason, for the abort message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(decode: Callable[[bytes], Any] | None, what: str) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        if decode is None:
            return data
        try:
            return decode(data)
        except Exception as exc:  # DecodeError, UnicodeDecodeError, ...: the bytes, not the server
            return Undecodable(f"the request to {what} is not a valid message ({type(exc).__name__}: {exc})")
    return run


def _sync(h: Any) -> Any:
    def check(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return request

    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            yield check(request, context)

    def unary(inner: Behavior) -> Behavior:
        return lambda request, context: inner(check(request, context), context)

    def stream(inner: Behavior) -> Behavior:
        return lambda requests, context: inner(checked(requests, context), context)

    return h._replace(
        unary_unary=h.unary_unary and unary(h.unary_unary), unary_stream=h.unary_stream and unary(h.unary_stream),
        stream_unary=h.stream_unary and stream(h.stream_unary),
        stream_stream=h.stream_stream and stream(h.stream_stream))


def _aio(h: Any) -> Any:
    async def check(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return request

    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            yield await check(request, context)

    def unary(inner: Behavior) -> Behavior:
        async def run(request: Any, context: Any) -> Any:
            return await inner(await check(request, context), context)
        return run

    def unary_gen(inner: Behavior) -> Behavior:
        async def run(request: Any, context: Any) -> AsyncIterator[Any]:
            async for item in inner(await check(request, context), context):
                yield item
        return run

    def stream(inner: Behavior) -> Behavior:
        async def run(requests: AsyncIterator[Any], context: Any) -> Any:
            return await inner(checked(requests, context), context)
        return run

    def stream_gen(inner: Behavior) -> Behavior:
        async def run(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for item in inner(checked(requests, context), context):
                yield item
        return run

    return h._replace(
        unary_unary=h.unary_unary and unary(h.unary_unary), unary_stream=h.unary_stream and unary_gen(h.unary_stream),
        stream_unary=h.stream_unary and stream(h.stream_unary),
        stream_stream=h.stream_stream and stream_gen(h.stream_stream))


class _Capture:
    """Stands in for a server while a generated ``add_*Servicer_to_server`` registers its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.services[service] = handlers


def add_servicer(add: Callable[[Any, Any], None], servicer: object, server: Any, *, aio: bool = False) -> None:
    """``add(servicer, server)`` (a generated ``add_*Servicer_to_server``), with decoding that
    answers INVALID_ARGUMENT for bytes that are not the method's request message."""
    capture = _Capture()
    add(servicer, capture)
    wrap = _aio if aio else _sync
    for service, handlers in capture.services.items():
        guarded = {name: wrap(h._replace(request_deserializer=_lenient(
            h.request_deserializer, f"{service}/{name}"))) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)
