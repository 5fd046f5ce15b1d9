"""Fault injection inside a rank, at a chosen op of a chosen step: for chaos runs
(bench/chaos.py) and for users who want to see their own job survive a rank dying in its
backward pass, its gradient sync or its optimizer step.

``RESIHP_FAULT="ACTION:RANK:STEP[:OP]"`` (set in the launcher's environment; every rank reads
it, only RANK acts): from step STEP on, the first time rank RANK is inside an op whose name
starts with OP (the runtime's op names: ``F`` forward chunk, ``B`` backward chunk, ``DP
all-reduce``, ``optimizer step``, ``switch`` a live reconfiguration, ``recv``/``send wait`` P2P;
no OP: anywhere in the step), the process gets ACTION: ``kill`` (SIGKILL, as ``kill -9`` from
outside) or ``stop`` (SIGSTOP: alive and silent, a hung rank). A watcher thread polls the
op cursor (trainer_hooks/reporting/opcursor.py) every half millisecond, so the signal lands
while the op runs, as an outside signal would, without any hook inside the op itself.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from resihp.trainer_hooks.reporting.opcursor import CURSOR

log = logging.getLogger(__name__)
FAULT_ENV = "RESIHP_FAULT"
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    action: str  # kill | stop
    rank: int
    step: int
    op: str = ""  # a prefix of the op's name; "" = any point of the step


def parse_fault(text: str) -> Fault:
    """``ACTION:RANK:STEP[:OP]``; a ValueError says what is wrong."""
    parts = text.split(":", 3)
    if len(parts) < 3 or parts[0] not in ACTIONS:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected ACTION:RANK:STEP[:OP] with ACTION one of "
                         f"{sorted(ACTIONS)}, e.g. kill:5:10:B")
    try:
        rank, step = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={text!r}: RANK and STEP must be integers") from None
    if rank < 0 or step < 0:
        raise ValueError(f"{FAULT_ENV}={text!r}: RANK and STEP must be >= 0")
    return Fault(parts[0], rank, step, parts[3] if len(parts) == 4 else "")


def due(fault: Fault, step: int, state: tuple[int, str, str, bool]) -> bool:
    """Whether the fault fires now: its step reached, and (given an op) inside a matching op."""
    if step < fault.step:
        return False
    if not fault.op:
        return True
    _, _, name, done = state
    return not done and name.startswith(fault.op)


def arm(fault: Fault, rank: int, current_step: Callable[[], int], poll_s: float = 0.0005) -> threading.Thread | None:
    """Start the watcher on the rank the fault names (None elsewhere)."""
    if rank != fault.rank:
        return None

    def watch() -> None:
        while not due(fault, current_step(), CURSOR.snapshot()):
            time.sleep(poll_s)
        step, op = current_step(), CURSOR.snapshot()[2]
        log.warning("resihp: injected fault: %s of rank %d at step %d in op %r", fault.action, rank, step, op)
        record(fault, rank, step, op)
        os.kill(os.getpid(), ACTIONS[fault.action])

    t = threading.Thread(target=watch, name="resihp-fault", daemon=True)
    t.start()
    return t


def record(fault: Fault, rank: int, step: int, op: str) -> None:
    """One line in ``$RESIHP_RUN_DIR/faults.jsonl``: when the fault landed (chaos runs time
    detection and recovery from it). Best effort: a run directory that cannot be written
    must not stop the fault."""
    run = os.environ.get("RESIHP_RUN_DIR", "")
    if not run:
        return
    line = json.dumps({"time": time.time(), "rank": rank, "action": fault.action, "step": step, "op": op})
    try:
        fd = os.open(os.path.join(run, "faults.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def arm_from_env(rank: int, current_step: Callable[[], int]) -> threading.Thread | None:
    text = os.environ.get(FAULT_ENV, "")
    return arm(parse_fault(text), rank, current_step) if text else None
