"""``AuthStore``: a ``torch.distributed.Store`` client of the job's authenticated store.

It speaks ``store_server``'s protocol after proving the rank credential, and c10d uses it
as any store: ``PrefixStore`` over it, gloo and NCCL groups built from it, blocking
``get`` / ``wait`` with the store's timeout. One connection per client, one call at a time
on it (c10d's own threads may call it too, so calls take a lock).

``connect(addr)`` is what resihp's code calls; the credential comes from
``$RESIHP_RANK_TOKEN`` (``resihp launch`` exports it to ranks), else is derived from
``$RESIHP_TOKEN`` where a process holds the job token itself.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from resihp.trainer_hooks.launch.store_server import (
    CREDENTIAL_ENV,
    OK,
    TIMEOUT,
    StoreAuthError,
    client_handshake,
    encode,
    read_frame,
)

DEFAULT_TIMEOUT = timedelta(seconds=300)
# while ``interrupt`` is set, a blocking wait is cut into slices this long and the predicate is
# asked between them
INTERRUPT_SLICE_S = 0.1

# c10d keeps only the C++ half of a Python store; once the Python object is collected its calls
# fail ("Not implemented"), e.g. a store handed to init_process_group and then dropped by the
# caller. Every client therefore stays referenced here until it is closed.
_LIVE: set[AuthStore] = set()


def credential_from_env() -> str:
    """The ranks' credential (``auth.rank_token_from_env``)."""
    from resihp.coordinator.protocol.auth import rank_token_from_env

    return rank_token_from_env()


def _b(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _ms(timeout: timedelta) -> bytes:
    return str(max(0, int(timeout.total_seconds() * 1000))).encode()


class AuthStore(dist.Store):  # type: ignore[misc,name-defined]  # torch's stub does not re-export Store
    """A client of ``store_server.StoreServer`` at ``host:port``."""

    def __init__(self, host: str, port: int, credential: str, timeout: timedelta = DEFAULT_TIMEOUT,
                 connect_timeout_s: float | None = None) -> None:
        super().__init__()
        if not credential:
            raise StoreAuthError(f"no credential for the job's store at {host}:{port}: set ${CREDENTIAL_ENV} "
                                 "(resihp launch exports it to every rank)")
        self.set_timeout(timeout)
        self.host, self.port = host, port
        self._credential = credential
        self._lock = threading.Lock()
        self._broken = False
        # a reason to stop waiting ('' while there is none): a switch sets it to "a member of
        # the new epoch was declared dead", so that gloo's rendezvous does not wait out its
        # timeout for a peer that will never come (reconfig.live.LiveReconfigurer.apply)
        self.interrupt: Callable[[], str] | None = None
        self._sock = self._connect(timeout.total_seconds() if connect_timeout_s is None else connect_timeout_s)
        _LIVE.add(self)

    def _connect(self, within_s: float) -> socket.socket:
        """Connect and authenticate; a store not up yet is retried (as TCPStore's client does)."""
        deadline = time.monotonic() + within_s
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(1.0, within_s))
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise dist.DistNetworkError(
                        f"Connection refused: no store at {self.host}:{self.port} within {within_s:.0f} s ({exc})"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_handshake(sock, self._credential.encode())
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            return sock

    @property
    def store_timeout(self) -> timedelta:
        """The timeout of blocking calls (c10d sets it with ``set_timeout``)."""
        timeout: timedelta = self.timeout  # pyright: ignore[reportAttributeAccessIssue]  # Store.timeout exists; torch's stub omits it
        return timeout

    def clone(self) -> AuthStore:
        """Another connection to the same store (c10d asks for one for background threads)."""
        return AuthStore(self.host, self.port, self._credential, self.store_timeout)

    def _reconnect_later(self) -> None:
        """Drop the broken connection; ``_call`` opens a new one first (lock held)."""
        try:
            self._sock.close()
        except OSError:
            pass
        self._broken = True

    # --- one round trip -----------------------------------------------------------------
    def _call(self, *fields: bytes, wait: timedelta | None = None) -> list[bytes]:
        """One request and its reply. ``wait``: how long the server may block on it; the socket
        gives up a little later, so a store that stopped answering cannot hold a rank for ever."""
        limit = None if wait is not None and not wait else (wait or timedelta(0)).total_seconds() + 30.0
        with self._lock:
            if self._broken:
                try:
                    self._sock = self._connect(min(5.0, self.store_timeout.total_seconds()))
                except (OSError, dist.DistNetworkError, StoreAuthError) as exc:
                    raise dist.DistNetworkError(f"Connection closed: the store at {self.host}:{self.port} is gone "
                                                f"({exc})") from None
                self._broken = False
            try:
                self._sock.settimeout(limit)
                self._sock.sendall(encode(fields))
                reply = read_frame(self._sock)
            except (OSError, ConnectionError) as exc:
                # the store may have been restarted on its address (resihp launch supervises it):
                # the next call reconnects; this one fails as a lost connection, never retried
                # (its effect on the old store is unknown)
                self._reconnect_later()
                raise dist.DistNetworkError(f"Connection closed: the store at {self.host}:{self.port}: {exc}") from None
        status, rest = reply[0], reply[1:]
        if status == OK:
            return rest
        message = rest[0].decode(errors="replace") if rest else status.decode()
        if status == TIMEOUT:
            raise dist.DistStoreError(message)
        raise RuntimeError(f"store call {fields[0].decode()}: {message}")

    # --- the Store interface ------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call(b"set", key.encode(), _b(value))

    def _blocking(self, op: bytes, keys: list[bytes], total: timedelta) -> list[bytes]:
        """A call the server holds until its keys exist, for up to ``total``; in slices while
        ``interrupt`` is set, raising a "wait timeout" (a peer failure to the runtime) as soon
        as it gives a reason."""
        interrupt = self.interrupt
        if interrupt is None:
            return self._call(op, *keys, _ms(total), wait=total)
        # a timeout of 0 is c10d's "no timeout", and so is a slice of 0 ms to the server: never send one
        deadline = time.monotonic() + total.total_seconds() if total.total_seconds() > 0 else float("inf")
        while True:
            piece = timedelta(seconds=max(0.001, min(INTERRUPT_SLICE_S, deadline - time.monotonic())))
            try:
                return self._call(op, *keys, _ms(piece), wait=piece)
            except dist.DistStoreError:
                names = [k.decode(errors="replace") for k in keys]
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"wait timeout after {total.total_seconds() * 1000:.0f}ms, keys: "
                                              f"{names}") from None
                why = interrupt()
                if why:
                    raise dist.DistStoreError(f"wait timeout cut short for keys {names}: {why}") from None

    def get(self, key: str) -> bytes:
        return self._blocking(b"get", [key.encode()], self.store_timeout)[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(b"add", key.encode(), str(int(value)).encode())[0])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(b"compare_set", key.encode(), _b(expected_value), _b(desired_value))[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call(b"append", key.encode(), _b(value))

    def check(self, keys: list[str]) -> bool:
        return self._call(b"check", *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._blocking(b"wait", [k.encode() for k in keys], self.store_timeout if timeout is None else timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._blocking(b"multi_get", [k.encode() for k in keys], self.store_timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call(b"multi_set", *(k.encode() for k in keys), *(_b(v) for v in values))

    def delete_key(self, key: str) -> bool:
        return self._call(b"delete_key", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"num_keys")[0])

    def has_extended_api(self) -> bool:
        return True  # append / multi_get / multi_set

    def close(self) -> None:
        """Close the connection (c10d must no longer use this client)."""
        _LIVE.discard(self)
        with self._lock:
            self._sock.close()


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def connect(addr: str, timeout: timedelta = DEFAULT_TIMEOUT, credential: str | None = None) -> AuthStore:
    """A client of the job's store at ``host:port`` (credential: ``credential_from_env()`` by default)."""
    host, port = parse_addr(addr)
    return AuthStore(host, port, credential_from_env() if credential is None else credential, timeout)
