"""Which operation this rank is in, for hang localisation (docs/detector.md, "Hangs").

The runtime marks each op it enters and completes: a compute chunk, a P2P receive or send
wait, the DP all-reduce, a TP all-reduce inside a compute op. The heartbeat thread reads the
latest mark and sends it with every beat, so when a job stops making progress while every
rank beats on, the coordinator can tell the rank that waits for nobody (inside a compute op,
or between ops) from the ranks that wait for it inside a p2p or collective op: the idea of
torch's NCCL flight recorder, at the granularity of the runtime's ops.

One cursor per process (``CURSOR``). A mark is one tuple assignment, atomic under the GIL:
the reader never sees half of it. Pure Python: no torch.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# (seq, kind, name, done): kind "" until the first op
State = tuple[int, str, str, bool]


class OpCursor:
    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: State = (0, "", "", True)

    def enter(self, kind: str, name: str) -> None:
        self._state = (self._state[0] + 1, kind, name, False)

    def done(self) -> None:
        seq, kind, name, _ = self._state
        self._state = (seq, kind, name, True)

    @contextmanager
    def op(self, kind: str, name: str) -> Iterator[None]:
        """Mark an op for the duration of the block. Nested (a TP all-reduce inside a compute
        op): the outer op is in progress again when the inner one returns."""
        outer = self._state
        self.enter(kind, name)
        try:
            yield
        finally:
            if outer[3]:  # not nested: the op is completed
                self.done()
            else:
                self._state = (self._state[0], outer[1], outer[2], False)

    def snapshot(self) -> State:
        return self._state


CURSOR = OpCursor()
