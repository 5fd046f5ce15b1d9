"""Hostile bytes on raw TCP connections to the job's store (trainer_hooks/launch/store_server.py).

Before the handshake: random bytes, a half or wrong challenge answer, store calls sent
without one; the store must refuse (a 0 verdict or a closed connection) and never serve a
key. After an honest handshake: random frames, truncated frames, a length past the frame
limit, a field count that lies, unknown calls, calls with missing or non-numeric arguments;
the store must answer each well-framed call (ok, err or timeout) and may drop a connection
whose framing is broken. After every ``check_every`` cases an authenticated client sets and
reads a key and the store's process must still run.
"""
from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

READ_S = 0.5  # how long a case waits for the store's answer


@dataclass
class StoreFuzzResult:
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # refused | closed | ok | err | timeout | silent
    unexpected: list[str] = field(default_factory=list)
    crashes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "outcomes": dict(sorted(self.outcomes.items())), "crashes": self.crashes,
                "unexpected": self.unexpected[:50], "unexpected_count": len(self.unexpected),
                "seconds": round(self.seconds, 3)}


def _ss() -> Any:
    from resihp.trainer_hooks.launch import store_server  # no torch; imported late so the fuzz package stays small

    return store_server


def _recv_some(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    out = b""
    sock.settimeout(READ_S)
    try:
        while len(out) < limit:
            chunk = sock.recv(limit - len(out))
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    return out


def _login(host: str, port: int, credential: str) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=5)
    _ss().client_handshake(sock, credential.encode())
    return sock


def _bad_calls(rng: random.Random) -> list[tuple[str, list[bytes]]]:
    """Well-framed store calls with wrong arguments: each must get an answer."""
    key = f"fuzz/{rng.randrange(100)}".encode()
    return [("unknown-call", [rng.randbytes(rng.randint(0, 12))]), ("get-no-args", [b"get"]),
            ("wait-timeout-not-a-number", [b"wait", key, b"soon"]), ("add-not-a-number", [b"add", key, b"x1"]),
            ("compare_set-arity", [b"compare_set", key]), ("set-no-value", [b"set"]),
            ("get-negative-timeout", [b"get", key, b"-5"]), ("delete-no-key", [b"delete_key"]),
            ("empty-call", [b""]), ("multi_get-no-keys", [b"multi_get", b"0"]),
            ("add-huge", [b"add", key, b"9" * 5000]),
            ("wait-timeout-overflows", [b"wait", b"fuzz/never", rng.choice((b"9" * 30, b"1" + b"0" * 400))])]


def _case(rng: random.Random, host: str, port: int, credential: str) -> tuple[str, str, str | None]:
    """Run one case; returns (what, outcome, why it is wrong or None)."""
    ss = _ss()
    roll = rng.random()
    if roll < 0.35:  # no credential
        with socket.create_connection((host, port), timeout=5) as sock:
            hello = _recv_some(sock, len(ss.MAGIC) + ss.NONCE_BYTES)
            what = rng.choice(("random", "half-answer", "wrong-proof", "calls-first", "nothing"))
            data = {"random": rng.randbytes(rng.randint(1, 300)), "half-answer": rng.randbytes(ss.NONCE_BYTES // 2),
                    "wrong-proof": rng.randbytes(ss.NONCE_BYTES + 32),
                    "calls-first": ss.encode([b"set", b"fuzz/owned", b"x"]) + ss.encode([b"get", b"fuzz/owned", b"10"]),
                    "nothing": b""}[what]
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)  # the store sees the end at once, not after its handshake timeout
            except OSError:
                pass
            answer = _recv_some(sock)
        if not hello.startswith(ss.MAGIC):
            return f"unauth.{what}", "silent", f"the store did not greet with its magic: {hello[:40]!r}"
        if answer not in (b"", b"\x00") and not (what == "calls-first" and answer.startswith(b"\x00")):
            return f"unauth.{what}", "served", f"an unauthenticated client got {answer[:60]!r}"
        return f"unauth.{what}", "refused" if answer else "closed", None
    sock = _login(host, port, credential)
    with sock:
        if roll < 0.7:
            what, fields = rng.choice(_bad_calls(rng))
            sock.sendall(ss.encode(fields))
            sock.settimeout(READ_S)
            try:
                status = ss.read_frame(sock)[0].decode()
            except (OSError, ConnectionError) as exc:
                return f"call.{what}", "silent", f"no answer to a well-framed call {fields[:2]!r}: {exc}"
            except (struct.error, IndexError, UnicodeDecodeError) as exc:
                return f"call.{what}", "garbled", f"an answer that is not a frame: {exc}"
            return f"call.{what}", status, None
        what = rng.choice(("random-bytes", "truncated-frame", "frame-too-large", "count-lies", "close-mid-frame"))
        frame = ss.encode([b"set", b"fuzz/k", rng.randbytes(20)])
        data = {"random-bytes": rng.randbytes(rng.randint(1, 400)), "truncated-frame": frame[:rng.randrange(1, len(frame))],
                "frame-too-large": struct.pack("!I", ss.MAX_FRAME_BYTES + 1) + b"\0" * 16,
                "count-lies": struct.pack("!I", 6) + struct.pack("!H", 9) + b"\0\0\0\0",
                "close-mid-frame": frame[:len(frame) // 2]}[what]
        sock.sendall(data)
        if what != "close-mid-frame":
            sock.shutdown(socket.SHUT_WR)
            _recv_some(sock)  # whatever it answers: a broken frame may end the connection
        return f"frame.{what}", "closed", None


def store_works(host: str, port: int, credential: str, pid: int | None = None) -> str | None:
    """None when an authenticated client can set and read a key (and ``pid`` runs); else why not."""
    ss = _ss()
    if pid is not None:
        try:
            os.kill(pid, 0)
        except OSError:
            return f"the store's process {pid} is gone"
    try:
        with _login(host, port, credential) as sock:
            value = os.urandom(8).hex().encode()
            sock.settimeout(5)
            sock.sendall(ss.encode([b"set", b"fuzz/alive", value]))  # one call at a time, as clients do
            first = ss.read_frame(sock)
            sock.sendall(ss.encode([b"get", b"fuzz/alive", b"1000"]))
            second = ss.read_frame(sock)
    except (OSError, ConnectionError, struct.error) as exc:
        return f"an authenticated client failed: {type(exc).__name__}: {exc}"
    if first != [ss.OK] or second != [ss.OK, value]:
        return f"an authenticated client read {second!r} after setting {value!r}"
    return None


def fuzz_store(host: str, port: int, credential: str, n_cases: int, seed: int, *, pid: int | None = None,
               check_every: int = 50) -> StoreFuzzResult:
    """Send ``n_cases`` seeded hostile connections at the store at ``host:port``."""
    rng = random.Random(seed)
    result, outcomes = StoreFuzzResult(), Counter[str]()
    started = time.monotonic()
    for i in range(n_cases):
        try:
            what, outcome, why = _case(rng, host, port, credential)
        except OSError as exc:  # the store went away, or would not take a connection
            what, outcome, why = "connect", "unreachable", f"{type(exc).__name__}: {exc}"
        result.cases += 1
        outcomes[outcome] += 1
        if why is not None:
            result.unexpected.append(f"case {i} (seed {seed}) {what}: {why}")
        if outcome == "unreachable" or (i + 1) % check_every == 0 or i == n_cases - 1:
            broken = store_works(host, port, credential, pid)
            if broken is not None:
                result.crashes += 1
                result.unexpected.append(f"after {i + 1} cases: {broken}")
                break
    result.seconds = time.monotonic() - started
    result.outcomes = dict(outcomes)
    return result
