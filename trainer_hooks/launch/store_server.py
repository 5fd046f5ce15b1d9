"""The job's rendezvous store: a small key-value server that answers only authenticated clients.

torch's ``TCPStore`` takes any client that can reach its port, and its server listens on
every interface whatever host it is given. This server replaces it for resihp's stores:

- it listens on exactly the address it is given (one socket, ``bind((host, port))``);
- every connection first proves it holds the job's rank credential (``auth.rank_token``)
  by a challenge-response (HMAC-SHA256 over both sides' nonces; the credential never
  crosses the wire, and the client checks the server's answer too, so a process that
  grabbed the port cannot pose as the store); a connection that fails is closed before
  it can read or write a key;
- after that it serves the store calls torch's c10d uses (set, get, add, compare_set,
  check, wait, delete_key, num_keys, append, multi_get, multi_set), blocking ones with the
  client's timeout. ``store_client.AuthStore`` is the client (a ``torch.distributed.Store``).

The traffic is not encrypted: on a network others can sniff or tamper with, the store's
values (rank addresses, the recovery agreement) are visible; see docs/control-plane.md.
No torch here: the server process stays small.
"""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from hashlib import sha256

log = logging.getLogger(__name__)

MAGIC = b"RESIHP-STORE/1\n"
NONCE_BYTES = 32
MAX_FRAME_BYTES = 64 << 20  # a value of the store (gloo addresses, NCCL ids, plans) is far smaller
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 128  # connections past this, not yet authenticated, are closed at once
CREDENTIAL_ENV = "RESIHP_RANK_TOKEN"  # also coordinator.protocol.auth.RANK_TOKEN_ENV

OK, ERR, TIMEOUT = b"ok", b"err", b"timeout"


class StoreAuthError(ConnectionError):
    """The other side does not hold the credential (or is not a resihp store)."""


# --- wire: [u32 length][u16 count]([u32 length][bytes])* ------------------------------
def encode(fields: Sequence[bytes]) -> bytes:
    body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    payload = struct.pack("!H", len(fields)) + body
    return struct.pack("!I", len(payload)) + payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("Connection closed by the store peer")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> list[bytes]:
    """One frame. Peers send one frame and wait for the answer, so a frame usually arrives in
    one ``recv``: read up to 64 KiB at once (one system call per message, not two)."""
    head = sock.recv(1 << 16)
    if not head:
        raise ConnectionError("Connection closed by the store peer")
    if len(head) < 4:
        head += recv_exact(sock, 4 - len(head))
    (size,) = struct.unpack_from("!I", head)
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"store frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    payload = head[4:]
    if len(payload) < size:
        payload += recv_exact(sock, size - len(payload))
    elif len(payload) > size:
        raise ConnectionError("the store peer sent a second frame before the answer to its first")
    (count,) = struct.unpack_from("!H", payload)
    out, at = [], 2
    for _ in range(count):
        (n,) = struct.unpack_from("!I", payload, at)
        out.append(payload[at + 4:at + 4 + n])
        at += 4 + n
    return out


# --- the handshake --------------------------------------------------------------------
def _mac(credential: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(credential, role + b"".join(nonces), sha256).digest()


def server_handshake(sock: socket.socket, credential: bytes) -> bool:
    """Challenge the client; True once it proved the credential (and got our proof back)."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_s)
    answer = recv_exact(sock, NONCE_BYTES + 32)
    nonce_c, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(credential, b"client", nonce_s, nonce_c)):
        sock.sendall(b"\x00")
        return False
    sock.sendall(b"\x01" + _mac(credential, b"server", nonce_c, nonce_s))
    return True


def client_handshake(sock: socket.socket, credential: bytes) -> None:
    """Prove the credential to the store, and check that the store holds it too."""
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise StoreAuthError("the peer is not a resihp store (a torch TCPStore, or another service?)")
    nonce_s = hello[len(MAGIC):]
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(nonce_c + _mac(credential, b"client", nonce_s, nonce_c))
    verdict = recv_exact(sock, 1)
    if verdict != b"\x01":
        raise StoreAuthError(f"the store refused this rank's credential (${CREDENTIAL_ENV}); is it this job's?")
    if not hmac.compare_digest(recv_exact(sock, 32), _mac(credential, b"server", nonce_c, nonce_s)):
        raise StoreAuthError("the store could not prove it holds the job's credential")


# --- the key-value state --------------------------------------------------------------
class _Table:
    """Keys and values, with waits for keys that are not there yet."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()

    def call(self, op: bytes, args: list[bytes]) -> list[bytes]:
        """One store call: returns the reply fields (status first)."""
        if op in (b"get", b"multi_get", b"wait"):
            *keys, timeout_ms = args
            with self.cond:  # wait and read under one hold of the lock: no delete slips in between
                limit_s = int(timeout_ms) / 1000.0 or None  # 0: no timeout, as c10d's kNoTimeout
                if not self.cond.wait_for(lambda: all(k in self.data for k in keys), limit_s):
                    missing = [k.decode(errors="replace") for k in keys if k not in self.data]
                    return [TIMEOUT, f"wait timeout after {int(timeout_ms)}ms, keys: {missing}".encode()]
                return [OK] if op == b"wait" else [OK, *(self.data[k] for k in keys)]
        with self.cond:
            d = self.data
            if op == b"set":
                d[args[0]] = args[1]
            elif op == b"multi_set":
                half = len(args) // 2
                d.update(zip(args[:half], args[half:]))
            elif op == b"append":
                d[args[0]] = d.get(args[0], b"") + args[1]
            elif op == b"add":
                value = int(d.get(args[0], b"0")) + int(args[1])
                d[args[0]] = str(value).encode()
                self.cond.notify_all()
                return [OK, str(value).encode()]
            elif op == b"compare_set":
                key, expected, desired = args
                current = d.get(key)
                if (current is None and expected == b"") or current == expected:
                    d[key] = desired
                    current = desired
                return [OK, expected if current is None else current]
            elif op == b"check":
                return [OK, b"1" if all(k in d for k in args) else b"0"]
            elif op == b"delete_key":
                return [OK, b"1" if d.pop(args[0], None) is not None else b"0"]
            elif op == b"num_keys":
                return [OK, str(len(d)).encode()]
            else:
                return [ERR, b"unknown store call " + op]
            self.cond.notify_all()
            return [OK]


class StoreServer:
    """Serves one ``_Table`` on exactly ``(host, port)`` to clients holding ``credential``."""

    def __init__(self, host: str, port: int, credential: str) -> None:
        if not credential:
            raise ValueError(f"the store needs a credential (${CREDENTIAL_ENV}); an empty one would let anyone in")
        self._credential = credential.encode()
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._sock = socket.socket(family, kind, proto)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "::" means IPv6 only, never the IPv4 wildcard as well
            self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self._sock.bind(addr)
        self._sock.listen(1024)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.table = _Table()
        self.refused = 0  # connections that failed the handshake
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept_loop, name="resihp-store", daemon=True)

    def start(self) -> StoreServer:
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            # connections not yet authenticated are capped: a peer that opens many and says
            # nothing cannot exhaust threads (authenticated ranks hold their own, few)
            if not self._pending.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="resihp-store-conn", daemon=True).start()
            except RuntimeError:  # can't start a new thread: refuse this one, keep accepting
                self._pending.release()
                self.refused += 1
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(HANDSHAKE_TIMEOUT_S)  # a client that says nothing does not hold a thread for ever
                ok = server_handshake(conn, self._credential)
            finally:
                self._pending.release()
            if not ok:
                self.refused += 1
                return
            conn.settimeout(None)
            while True:
                fields = read_frame(conn)
                if not fields:
                    return
                try:
                    reply = self.table.call(fields[0], fields[1:])
                except (ValueError, IndexError, KeyError, OverflowError) as exc:  # e.g. a wait of 10**30 ms
                    reply = [ERR, f"malformed store call {fields[0]!r}: {exc}".encode()]
                conn.sendall(encode(reply))
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def serve_until(stop: Callable[[], object], host: str, port: int, credential: str) -> int:
    """Run a store, print ``{"host", "port"}`` as one JSON line, serve until ``stop()`` returns."""
    server = StoreServer(host, port, credential).start()
    print(json.dumps({"host": host, "port": server.port, "pid": os.getpid()}), flush=True)
    try:
        stop()
    finally:
        server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resihp.trainer_hooks.launch.store_server",
                                     description="host the job's store until stdin closes (credential: "
                                                 f"${CREDENTIAL_ENV}, never on the command line)")
    parser.add_argument("--host", default="127.0.0.1", help="the one address to listen on")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    credential = os.environ.pop(CREDENTIAL_ENV, "")
    if not credential:
        print(f"store_server: set ${CREDENTIAL_ENV} (the job's rank credential)", file=sys.stderr)
        return 2
    return serve_until(sys.stdin.read, args.host, args.port, credential)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())

