"""The real exit status of a local rank, even when its parent reaps it first.

Ranks are children of Open MPI's daemon, which reaps them at once: the agent's read of the
zombie's status in /proc (agent/pidwatch.py) often comes too late, and a SIGKILLed rank was
reported with an unknown status. The kernel's process-events connector (netlink
``NETLINK_CONNECTOR``, ``CN_IDX_PROC``) announces every exit with its wait status as it
happens; a listener thread keeps the latest statuses by pid. Linux only, and it needs
CAP_NET_ADMIN (root) and the host's PID namespace; elsewhere it stays off and the /proc read is
all there is.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from collections import OrderedDict

log = logging.getLogger(__name__)

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_EXIT = 0x80000000
NLMSG_HDR = struct.Struct("IHHII")  # len, type, flags, seq, pid
CN_MSG = struct.Struct("IIIIHH")  # idx, val, seq, ack, len, flags
EVENT_HDR = struct.Struct("IIQ")  # what, cpu, timestamp_ns
EXIT_EVENT = struct.Struct("IIII")  # pid, tgid, exit_code (a wait status), exit_signal
NLMSG_DONE = 3


def decode_status(status: int) -> int:
    """A wait status as pidwatch reports it: the exit code, or -signal."""
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def parse_exits(data: bytes) -> list[tuple[int, int]]:
    """(pid, wait status) of every process (thread-group leader) exit in one netlink datagram."""
    out = []
    off = 0
    while off + NLMSG_HDR.size <= len(data):
        length = NLMSG_HDR.unpack_from(data, off)[0]
        if length < NLMSG_HDR.size:
            break
        body = off + NLMSG_HDR.size + CN_MSG.size
        if body + EVENT_HDR.size + EXIT_EVENT.size <= off + length:
            what = EVENT_HDR.unpack_from(data, body)[0]
            if what == PROC_EVENT_EXIT:
                pid, tgid, status, _ = EXIT_EVENT.unpack_from(data, body + EVENT_HDR.size)
                if pid == tgid:  # a thread ending is not its process ending
                    out.append((pid, status))
        off += (length + 3) & ~3
    return out


class ExitNotes:
    """Listens for process exits; ``status(pid)`` is the decoded status once it was seen."""

    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._seen: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = False
        self.enabled = False
        self.why_off = ""
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
            self._sock.bind((0, CN_IDX_PROC))
            op = struct.pack("I", PROC_CN_MCAST_LISTEN)
            cn = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
            self._sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(cn), NLMSG_DONE, 0, 0, os.getpid()) + cn)
        except (OSError, AttributeError) as exc:  # not Linux, no CAP_NET_ADMIN, no connector
            self.why_off = f"process-events connector unavailable ({exc}); exit statuses come from /proc only"
            log.info("%s", self.why_off)
            return
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="exitnotes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.5)
                if not ready:
                    continue
                data = self._sock.recv(65536)
            except OSError:
                if self._stop:
                    return
                continue  # e.g. ENOBUFS under a burst of events: keep listening
            exits = parse_exits(data)
            if exits:
                with self._cond:
                    for pid, status in exits:
                        self._seen[pid] = status
                        self._seen.move_to_end(pid)
                    while len(self._seen) > self._keep:
                        self._seen.popitem(last=False)
                    self._cond.notify_all()

    def status(self, pid: int, wait_s: float = 0.1) -> int | None:
        """The exit status of ``pid`` (code, or -signal), waiting up to ``wait_s`` for its event;
        None when not seen (or the listener is off)."""
        if not self.enabled:
            return None
        deadline = time.monotonic() + wait_s
        with self._cond:
            while pid not in self._seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return decode_status(self._seen[pid])

    def close(self) -> None:
        self._stop = True
        if self.enabled:
            self._sock.close()
