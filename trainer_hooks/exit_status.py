"""How the process is ending, for the exit hook that closes a job (``Job._close_at_exit``).

An exit hook cannot read the status the interpreter will exit with. An uncaught exception
leaves ``sys.last_value`` (``sys.last_exc`` from Python 3.12); ``sys.exit(status)`` leaves
nothing, so ``install`` wraps ``sys.exit`` to record its status (one wrapper per process:
``sys.exit`` is process-wide). A rank that fails must not say goodbye as if it finished, and
must not wait in MPI's finalisation for peers blocked in a collective with it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn


class ExitStatus:
    def __init__(self) -> None:
        self.code: str | int | None = None  # what the script passed to sys.exit, if it called it
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        original = sys.exit

        def exit_recording(status: str | int | None = None, /) -> NoReturn:
            self.code = status
            original(status)

        sys.exit = exit_recording

    def failure(self) -> tuple[str, int] | None:
        """(why, exit status) when the process ends on a failure, else None."""
        if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
            return "an uncaught exception", 1
        if self.code not in (None, 0):
            return f"sys.exit({self.code!r})", self.code if isinstance(self.code, int) else 1
        return None


EXIT_STATUS = ExitStatus()


def leave_now(code: int, *, as_failed_process: bool = False) -> NoReturn:
    """Flush what the user would want to read, then end the process without its exit steps.

    ``as_failed_process``: end by SIGKILL instead of an exit status. Open MPI's ULFM does not
    report a process that *exits* (even non-zero, without MPI_Finalize) as failed, so survivors
    that shrink the communicator wait for it forever; a process killed by a signal is reported
    at once. A resilient job's failed rank leaves this way (its reason is logged first)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    if as_failed_process:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)
