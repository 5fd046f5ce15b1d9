"""Per-rank compute timings for a loop resihp does not run (``job.timed``).

In a synchronous DDP step every rank waits for the slowest at the gradient all-reduce, so
every rank's step takes the same wall time and the step time alone cannot say *which* rank
is slow. Its own forward and backward spans can:

    for it in range(steps):
        for mb, (x, y) in enumerate(micro_batches):
            with job.timed("F"):
                loss = model(x, y)
            with job.timed("B"):
                loss.backward()
        with job.timed("OPT"):
            opt.step()
        job.step(loss=loss, tokens=tokens_per_step, seqlens=[[T]] * B)

Each span costs two ``perf_counter`` calls. Micro-batch indices count up per kind within an
iteration (or pass ``mb=``); ``job.step`` hands the spans to the report as its chunks, times
relative to the iteration's start, and starts the next iteration's list.
"""
from __future__ import annotations

import time
from types import TracebackType

from resihp.coordinator.model.spec import SpecError

KINDS = ("F", "B", "W", "OPT", "DP")
Chunk = tuple[str, int, int, float, float]  # kind, micro-batch, chunk, start_s, end_s (from the iteration start)


class ChunkRecorder:
    """This rank's timed spans of the current iteration."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin  # perf_counter at the iteration start
        self._chunks: list[Chunk] = []
        self._next_mb: dict[str, int] = {}
        self._open: Span | None = None

    def timed(self, kind: str, mb: int | None = None) -> Span:
        """A context manager timing one span of ``kind`` (F, B, W, OPT, DP)."""
        if kind not in KINDS:
            raise SpecError(f"job.timed({kind!r}): unknown kind; use one of {', '.join(KINDS)}")
        if self._open is not None:
            raise SpecError(f"job.timed({kind!r}) inside job.timed({self._open.kind!r}): spans do not nest; "
                            "time the forward and the backward one after the other")
        if kind in ("OPT", "DP"):
            index = -1  # one per iteration (ChunkTiming: microbatch -1)
        elif mb is None:
            index = self._next_mb.get(kind, 0)
        else:
            index = int(mb)
        if index >= 0:
            self._next_mb[kind] = index + 1
        span = Span(self, kind, index)
        self._open = span
        return span

    def _close(self, span: Span, end: float) -> None:
        self._open = None
        self._chunks.append((span.kind, span.mb, 0, span.start - self.origin, end - self.origin))

    def take(self) -> tuple[Chunk, ...]:
        """The spans recorded since the last call (the iteration's chunks); micro-batch numbers
        start again at 0."""
        out = tuple(self._chunks)
        self._chunks = []
        self._next_mb = {}
        return out

    def restart(self, origin: float) -> None:
        """The next iteration starts at ``origin`` (a ``perf_counter`` value)."""
        self.origin = origin

    def __len__(self) -> int:
        return len(self._chunks)


class Span:
    """One timed span (``with job.timed(kind):``); closing it records it."""

    __slots__ = ("recorder", "kind", "mb", "start")

    def __init__(self, recorder: ChunkRecorder, kind: str, mb: int) -> None:
        self.recorder = recorder
        self.kind = kind
        self.mb = mb
        self.start = 0.0

    def __enter__(self) -> Span:
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.recorder._close(self, time.perf_counter())  # pyright: ignore[reportPrivateUsage]  # its own recorder
