"""What a trainer does with a coordinator's notice (``NoticeCommand``): print it, and on a
peer's failure end this process instead of letting it hang.

A notice is information, never an order: it is not applied at a step boundary and not
acknowledged. It arrives on the agent client's command thread, so nothing here runs on (or
blocks) a training step.

- ``finding``: one plain line on stderr, ``resihp: fail-slow finding: rank 2 compute ×1.31 (…)``.
- ``peer-failure``: a summary block on stderr (which rank, when, what is lost, what to do,
  with ``$RESIHP_RESTART_CMD`` as the exact command where the launcher set it); then, when
  ``exit_on_peer_failure`` is on (the default for an observe-only job, whose process group a
  dead peer has broken), the default process group is aborted where that is cheap and the
  process ends with ``PEER_FAILURE_EXIT_CODE`` (75, EX_TEMPFAIL: try again from the last
  checkpoint). A resilient job recovers by itself and keeps running.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

from resihp.coordinator.protocol import messages as m

log = logging.getLogger(__name__)
PEER_FAILURE_EXIT_CODE = 75  # EX_TEMPFAIL: a peer died, the job must restart from its last checkpoint
RESTART_ENV = "RESIHP_RESTART_CMD"  # the exact restart command (``resihp launch`` sets it)
EXIT_ENV = "RESIHP_EXIT_ON_PEER_FAILURE"  # 1 / 0: override the default (on for observe-only jobs)
ABORT_WAIT_S = 1.0  # the most time spent aborting the process group before exiting anyway


def exit_on_peer_failure_default(reshapes: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """``$RESIHP_EXIT_ON_PEER_FAILURE`` (1/0, on/off, true/false) if set, else on for a job that
    cannot reshape (observe-only) and off for a resilient one (it recovers from a dead peer)."""
    text = environ.get(EXIT_ENV, "").strip().lower()
    if text in ("1", "on", "true", "yes"):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    if text:
        log.warning("resihp: %s=%r is not 1/0; using the default", EXIT_ENV, text)
    return not reshapes


def finding_line(notice: m.NoticeCommand) -> str:
    """The one line a finding notice prints."""
    return f"resihp: {notice.text}"


def _when(time_s: float) -> str:
    if time_s <= 0:
        return "at an unknown time"
    return "at " + time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time_s)) + f".{int(time_s % 1 * 1000):03d} UTC"


def peer_failure_block(notice: m.NoticeCommand, rank: int, exiting: bool,
                       environ: Mapping[str, str] = os.environ) -> str:
    """The summary a surviving rank prints when a peer has died (several lines, one block)."""
    after = f"after iteration {notice.iteration}" if notice.iteration >= 0 else "before its first iteration"
    who = f"rank {notice.rank}" if notice.rank >= 0 else "a peer rank"
    lines = [
        f"resihp: ===== peer failure: {who} is gone =====",
        f"resihp: what: {notice.text}",
        f"resihp: when: {_when(notice.time_s)}, {after} (cause: {notice.cause or 'unknown'})",
        "resihp: lost: this job cannot continue: its process group is broken; the steps since the last "
        "checkpoint are lost",
    ]
    restart = environ.get(RESTART_ENV, "").strip()
    if restart:
        lines.append("resihp: to do: restart from the last checkpoint with:")
        lines.append(f"resihp:   {restart}")
    else:
        lines.append("resihp: to do: restart the job from its last checkpoint")
    lines.append(f"resihp: rank {rank} exits now with code {PEER_FAILURE_EXIT_CODE} instead of waiting in a collective"
                 if exiting else f"resihp: rank {rank} keeps running (exit on peer failure is off)")
    return "\n".join(lines)


def abort_process_group(wait_s: float = ABORT_WAIT_S) -> None:
    """Abort (else destroy) torch.distributed's default group, if torch is loaded and one is up,
    on a helper thread for at most ``wait_s``: a collective blocked on the dead peer must not
    keep this process alive, and aborting must not hang it either."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return

    def run() -> None:
        try:
            if not dist.is_available() or not dist.is_initialized():
                return
            c10d = sys.modules.get("torch.distributed.distributed_c10d")
            abort = getattr(c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # best effort: the process exits next either way
            log.debug("resihp: aborting the process group failed: %s", exc)

    t = threading.Thread(target=run, name="resihp-abort-pg", daemon=True)
    t.start()
    t.join(wait_s)


class NoticeHandler:
    """The agent client's default ``on_notice``. ``exit_fn`` / ``abort_fn`` / ``stream`` are
    injectable (tests); the real ones are ``os._exit``, ``abort_process_group`` and stderr."""

    def __init__(self, rank: int, exit_on_peer_failure: bool, stream: IO[str] | None = None,
                 exit_fn: Callable[[int], object] = os._exit, abort_fn: Callable[[], None] = abort_process_group,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.rank = rank
        self.exit_on_peer_failure = exit_on_peer_failure
        self.stream = stream
        self.exit_fn = exit_fn
        self.abort_fn = abort_fn
        self.environ = environ
        self.peer_failed: m.NoticeCommand | None = None  # the first peer failure seen

    def _write(self, text: str) -> None:
        out = self.stream or sys.stderr
        try:
            out.write(text + "\n")
            out.flush()
        except (OSError, ValueError):  # a closed stderr must not break the command thread
            pass

    def __call__(self, notice: m.NoticeCommand) -> None:
        if notice.kind != "peer-failure":
            self._write(finding_line(notice))
            return
        if notice.rank == self.rank or self.peer_failed is not None:
            return  # about this rank itself (a fenced process), or a second failure: one block is enough
        self.peer_failed = notice
        self._write(peer_failure_block(notice, self.rank, self.exit_on_peer_failure, self.environ))
        if self.exit_on_peer_failure:
            try:
                sys.stdout.flush()  # os._exit skips Python's buffers
            except (OSError, ValueError):
                pass
            self.abort_fn()
            self.exit_fn(PEER_FAILURE_EXIT_CODE)
