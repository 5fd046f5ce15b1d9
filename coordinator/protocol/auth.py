"""Per-job token and optional TLS for the coordinator and Admin endpoints.

The launcher generates one random token per job and stores it with mode 0600; agents
get it through ``RESIHP_TOKEN``; ``resihp admin`` reads it from ``--token``,
``RESIHP_TOKEN`` or ``--token-file``. Calls carry ``authorization: Bearer <token>``
metadata; a server interceptor answers UNAUTHENTICATED otherwise. Health checks and
reflection stay open (they reveal nothing and change nothing).

Ranks hold a credential of their own, ``rank_token(token)`` (``$RESIHP_RANK_TOKEN``): it opens
the job's store and the agents' Hook service, not the coordinator or Admin.
"""
from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HEADER = "authorization"


class AuthError(ValueError):
    pass


def generate_token() -> str:
    return secrets.token_urlsafe(32)


RANK_TOKEN_ENV = "RESIHP_RANK_TOKEN"


def rank_token(token: str) -> str:
    """The ranks' credential, derived from the job token: it opens the job's store and the
    agents' Hook service, never the coordinator or Admin (a rank cannot act as an operator,
    and the job token cannot be recovered from it)."""
    if not token:
        raise AuthError("no job token to derive the ranks' credential from")
    return hmac.new(token.encode(), b"resihp ranks v1", "sha256").hexdigest()


def rank_token_from_env() -> str:
    """``$RESIHP_RANK_TOKEN`` (``resihp launch`` exports it to ranks), else derived from
    ``$RESIHP_TOKEN`` (a process that holds the job token); "" when neither is set."""
    if os.environ.get(RANK_TOKEN_ENV):
        return os.environ[RANK_TOKEN_ENV]
    return rank_token(os.environ["RESIHP_TOKEN"]) if os.environ.get("RESIHP_TOKEN") else ""


def write_token(path: Path, token: str) -> None:
    """Write the token readable by its owner only (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)


def read_token(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise AuthError(f"token file {path} does not exist; pass --token or set RESIHP_TOKEN") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"token file {path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    token = path.read_text().strip()
    if not token:
        raise AuthError(f"token file {path} is empty")
    return token


def resolve_token(token: str | None, token_file: str | None) -> str:
    """CLI > env > file. Empty string means no token configured."""
    if token:
        return token
    if os.environ.get("RESIHP_TOKEN"):
        return os.environ["RESIHP_TOKEN"]
    path = token_file or os.environ.get("RESIHP_TOKEN_FILE")
    return read_token(Path(path)) if path else ""


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call without the job token, except health and reflection."""

    def __init__(self, token: str) -> None:
        if not token:
            raise AuthError("an empty token would let anyone in; generate one with resihp launch")
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong job token: pass --token / RESIHP_TOKEN (see the run directory's token file)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_stream_unary = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER:
                given = value.encode() if isinstance(value, str) else value
        if given and hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return self._deny_stream
        if handler.request_streaming:
            return self._deny_stream_unary
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """``TokenInterceptor`` for an asyncio server (the agent's Hook service)."""

    def __init__(self, token: str, what: str = "job token") -> None:
        if not token:
            raise AuthError("an empty token would let anyone in")
        self._expected = f"Bearer {token}".encode()
        message = f"missing or wrong {what}"

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER:
                given = value.encode() if isinstance(value, str) else value
        handler = await continuation(handler_call_details)
        if handler is None or (given and hmac.compare_digest(given, self._expected)):
            return handler
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]


def metadata(token: str) -> Sequence[tuple[str, str]]:
    return ((HEADER, f"Bearer {token}"),) if token else ()


def server_credentials(cert: str | None, key: str | None, client_ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS for a server when both --tls-cert and --tls-key are given; None = plaintext."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise AuthError("TLS needs both --tls-cert and --tls-key")
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel(target: str, ca: str | None = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A client channel: TLS when a CA file is given (``--tls-ca``), else plaintext."""
    if ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
        return grpc.secure_channel(target, creds, options=list(options))
    return grpc.insecure_channel(target, options=list(options))
