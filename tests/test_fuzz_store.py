"""Hostile bytes on raw connections to the job's store (a real store process): it refuses or drops
them, answers every well-framed call, keeps running, and its authenticated clients still work."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resihp.coordinator.fuzz.store import _login, fuzz_store, store_works
from resihp.trainer_hooks.launch.store_server import encode, read_frame
from resihp.trainer_hooks.reconfig.ulfm import StoreProcess

CREDENTIAL = "store-fuzz-credential"
FEW = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def store() -> Iterator[StoreProcess]:
    with StoreProcess(credential=CREDENTIAL) as s:
        yield s


def test_a_burst_of_1000_hostile_connections_leaves_the_store_serving(store: StoreProcess) -> None:
    result = fuzz_store(store.host, store.port, CREDENTIAL, 1000, seed=5, pid=store.proc.pid)
    assert result.crashes == 0 and result.unexpected == [], result.unexpected[:5]
    assert {"refused", "closed", "err"} <= set(result.outcomes)
    assert store.proc.poll() is None
    assert store_works(store.host, store.port, CREDENTIAL, store.proc.pid) is None


@pytest.mark.parametrize("timeout_ms", [b"9" * 30, b"1" + b"0" * 400])
def test_a_wait_whose_timeout_overflows_is_answered_not_dropped(store: StoreProcess, timeout_ms: bytes) -> None:
    """The connection's thread died of an OverflowError (no answer, a traceback on stderr)."""
    with _login(store.host, store.port, CREDENTIAL) as sock:
        sock.settimeout(5)
        sock.sendall(encode([b"wait", b"fuzz/never", timeout_ms]))
        status, why = read_frame(sock)
    assert status == b"err" and why.startswith(b"malformed store call b'wait'")


@FEW
@given(data=st.binary(max_size=512))
def test_raw_bytes_before_the_handshake_are_refused(store: StoreProcess, data: bytes) -> None:
    with socket.create_connection((store.host, store.port), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        got = b""
        while chunk := sock.recv(4096):
            got += chunk
    assert got[:1] == b"R"  # its greeting (magic and nonce), then at most a refusal
    assert len(got) - len(b"RESIHP-STORE/1\n") - 32 in (0, 1)
    assert store_works(store.host, store.port, CREDENTIAL) is None


@FEW
@given(data=st.binary(max_size=512))
def test_raw_bytes_after_the_handshake_never_take_the_store_down(store: StoreProcess, data: bytes) -> None:
    with _login(store.host, store.port, CREDENTIAL) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        while sock.recv(4096):
            pass
    assert store_works(store.host, store.port, CREDENTIAL, store.proc.pid) is None
