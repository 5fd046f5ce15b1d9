"""Exit statuses from the kernel's process-events connector (agent/exitnotes.py): a SIGKILLed
child reaped by its own parent before anyone reads /proc is still reported as signal 9."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from resihp.agent.exitnotes import (
    CN_MSG,
    EVENT_HDR,
    EXIT_EVENT,
    NLMSG_HDR,
    PROC_EVENT_EXIT,
    ExitNotes,
    decode_status,
    parse_exits,
)


def _datagram(pid: int, tgid: int, status: int, what: int = PROC_EVENT_EXIT) -> bytes:
    body = EVENT_HDR.pack(what, 0, 0) + EXIT_EVENT.pack(pid, tgid, status, 17)
    cn = CN_MSG.pack(1, 1, 0, 0, len(body), 0) + body
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(cn), 3, 0, 0, 0) + cn


def test_exit_events_are_parsed_and_thread_exits_and_other_events_ignored() -> None:
    assert parse_exits(_datagram(42, 42, 9)) == [(42, 9)]
    assert parse_exits(_datagram(43, 42, 9)) == []  # a thread of process 42
    assert parse_exits(_datagram(42, 42, 0, what=0x1)) == []  # a fork event
    assert parse_exits(b"\0" * 7) == []
    assert decode_status(9) == -9 and decode_status(3 << 8) == 3 and decode_status(0) == 0


def test_a_child_killed_and_reaped_at_once_is_reported_killed_by_signal_9() -> None:
    notes = ExitNotes()
    if not notes.enabled:
        pytest.skip(notes.why_off)
    try:
        # the grandchild's parent (this shell) reaps it at once, as mpirun's daemon reaps a rank
        out = subprocess.run(["sh", "-c", "sleep 30 & echo $!; kill -9 $!; wait"], capture_output=True, text=True,
                             timeout=30)
        pid = int(out.stdout.split()[0])
        assert notes.status(pid, wait_s=5.0) == -signal.SIGKILL
        code = subprocess.run([sys.executable, "-c", "import os; print(os.getpid()); raise SystemExit(3)"],
                              capture_output=True, text=True, timeout=30)
        assert notes.status(int(code.stdout), wait_s=5.0) == 3
        assert notes.status(os.getpid(), wait_s=0.0) is None
    finally:
        notes.close()

