"""Notice at once when a local rank's process exits.

Ranks are children of mpirun, not of the agent, so the agent cannot ``wait`` for them.
On Linux ≥ 5.3 a pidfd becomes readable the moment its process exits: one thread polls
all pidfds (plus a wake-up pipe). Elsewhere it falls back to polling every
``poll_s``. A zombie counts as exited. The exit status is read from /proc while the
zombie still exists; a process whose threads are still exiting is read again for a few
milliseconds; one reaped first is looked up in the kernel's exit events (agent/exitnotes.py),
else reported as unknown (``EXIT_UNKNOWN``, never as a guessed signal).
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

from resihp.agent.exitnotes import ExitNotes
from resihp.coordinator.protocol.messages import EXIT_UNKNOWN

log = logging.getLogger(__name__)
ExitCallback = Callable[[int, int, int], None]  # (rank, pid, code)


def _read_exit(pid: int) -> int | None:
    """The zombie's status (code, or -signal); None while it is not a zombie yet; EXIT_UNKNOWN
    when it is gone (reaped) or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z":
            return None
        if len(fields) < 50:
            return EXIT_UNKNOWN
        status = int(fields[-1])
        return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
    except (OSError, ValueError, IndexError):
        return EXIT_UNKNOWN


def exit_code_of(pid: int, settle_s: float = 0.05) -> int:
    """Exit status of an exited process as waitpid would decode it: code, or -signal;
    ``EXIT_UNKNOWN`` if it cannot be read. A pidfd fires as the process exits: its threads may
    still be exiting (state not yet Z), so it is read again for up to ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        code = _read_exit(pid)
        if code is not None:
            return code
        if time.monotonic() >= deadline:
            return EXIT_UNKNOWN
        time.sleep(0.002)


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
        return text[text.rindex(")") + 2:].startswith("Z")
    except (OSError, ValueError):
        return True


class PidWatch:
    def __init__(self, on_exit: ExitCallback, poll_s: float = 0.1, notes: ExitNotes | None = None) -> None:
        self.on_exit = on_exit
        self.poll_s = poll_s
        self.notes = notes if notes is not None else ExitNotes()  # exits its reaping parent hides
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[list[int], int | None]] = {}  # pid -> (ranks, pidfd); a process may run several ranks
        self._rfd, self._wfd = os.pipe()
        self._stop = False
        self._use_pidfd = hasattr(os, "pidfd_open")
        self._thread = threading.Thread(target=self._run, name="pidwatch", daemon=True)
        self._thread.start()

    def watch(self, rank: int, pid: int) -> None:
        with self._lock:
            if pid in self._watched:
                if rank not in self._watched[pid][0]:
                    self._watched[pid][0].append(rank)
                return
            fd = None
            if self._use_pidfd:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    fd = None
                except OSError:
                    self._use_pidfd = False
            self._watched[pid] = ([rank], fd)
        os.write(self._wfd, b"x")

    def unwatch(self, pid: int) -> None:
        with self._lock:
            item = self._watched.pop(pid, None)
        if item and item[1] is not None:
            os.close(item[1])

    def watched(self) -> dict[int, int]:
        with self._lock:
            return {rank: pid for pid, (ranks, _) in self._watched.items() for rank in ranks}

    def _fire(self, pid: int) -> None:
        with self._lock:
            item = self._watched.pop(pid, None)
        if item is None:
            return
        ranks, fd = item
        code = exit_code_of(pid)
        if code == EXIT_UNKNOWN:  # reaped by its parent (mpirun's daemon) before /proc could be read
            noted = self.notes.status(pid)
            code = noted if noted is not None else code
        if fd is not None:
            os.close(fd)
        for rank in ranks:
            try:
                self.on_exit(rank, pid, code)
            except Exception:
                log.exception("exit callback failed for rank %d", rank)

    def _run(self) -> None:
        while not self._stop:
            poller = select.poll()
            poller.register(self._rfd, select.POLLIN)
            with self._lock:
                by_fd = {fd: pid for pid, (_, fd) in self._watched.items() if fd is not None}
                unpolled = [pid for pid, (_, fd) in self._watched.items() if fd is None]
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            timeout_ms = int(self.poll_s * 1000) if unpolled else 1000
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._rfd:
                    os.read(self._rfd, 4096)
                elif fd in by_fd:
                    self._fire(by_fd[fd])
            for pid in unpolled:
                if is_gone(pid):
                    self._fire(pid)

    def close(self) -> None:
        self._stop = True
        self.notes.close()
        os.write(self._wfd, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for _, fd in self._watched.values():
                if fd is not None:
                    os.close(fd)
            self._watched.clear()
        os.close(self._rfd)
        os.close(self._wfd)
