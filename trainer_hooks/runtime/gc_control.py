"""Python's garbage collector off the training's critical path.

A process that imported torch holds ~170,000 objects that live as long as it does (modules,
types, the model). A full collection (generation 2) walks all of them: 66 ms measured on this
machine, for nothing, each time the collector decides it is due. It fires at whatever
allocation tips it over: inside a step (one rank slower than its peers for one iteration — a
straggler the others wait for, and noise the detector must tell from a slow device) or
inside a recovery (in a process that had only imported torch, the reshard plan's first call
took 60–80 ms, of which ~67 ms were such a collection).

So, as large training stacks do (Megatron-LM's ``--manual-gc``, torchtitan's ``gc_freq``):

- ``settle()`` once the job is set up (``hooks.init``): collect what is garbage now, then
  ``gc.freeze()`` what lives: later collections skip the frozen heap (bench/gc_pause.py: a
  full collection 120 ms before, 0.008 ms after, with the runtime's GPT and AdamW built;
  new objects are collected as before). Not again after each switch: that cost the recovery
  1–13 ms for nothing measurable, the heap frozen at start-up being the bulk;
- ``paused()`` around a switch or a recovery: no automatic collection inside it.

In a real fail-stop recovery (bench/chaos.py, kill in forward) neither moved the downtime:
no full collection happened to fall inside it there; they keep one from ever doing so.
Frozen objects are never collected by the cycle collector (reference counting still frees
them): a cycle of start-up objects that becomes garbage later stays.

``RESIHP_GC=off`` leaves the collector alone (e.g. a loop that manages it itself).
"""
from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "RESIHP_GC"
_lock = threading.Lock()
_pauses = 0  # nested pauses in force
_was_enabled = True


def managed() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def settle() -> None:
    """Collect today's garbage, then freeze what survives out of every later collection."""
    if not managed():
        return
    gc.collect()
    gc.freeze()


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block (nesting and threads allowed)."""
    global _pauses, _was_enabled
    if not managed():
        yield
        return
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
