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
from typing import Any

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

    def record(self, kind: str, start: float, end: float) -> None:
        """A span timed elsewhere (``perf_counter`` values), numbered as ``timed`` would."""
        index = self._next_mb.get(kind, 0)
        self._next_mb[kind] = index + 1
        self._chunks.append((kind, index, 0, start - self.origin, end - self.origin))

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

    @property
    def busy(self) -> bool:
        """Whether a span is open (the loop's own ``job.timed`` around a forward)."""
        return self._open is not None


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


class ForwardTimer:
    """Times a user's module's training forward and backward passes as this rank's F and B
    spans, with no code in the loop: ``init(model=module)`` installs it (the two calls stay two).

    F: a forward pre-hook opens the span, a forward hook closes it; each training forward is one
    micro-batch. Passes under ``torch.no_grad`` or in ``eval()`` mode (nanoGPT's
    ``estimate_loss``) are not training micro-batches and are skipped, and so are passes inside
    a span the loop opened itself (``job.timed``). A first positional (or ``input_ids`` /
    ``idx``) integer tensor of shape (B, T) gives the micro-batch's sequence lengths ``[T] * B``.

    B: from the first gradient that reaches the forward's outputs to the last gradient
    accumulated into a parameter — the backward's own compute. In DDP the backward then waits
    for the gradient all-reduce, which holds the wait for the slowest replica: that wait is
    left out, so a healthy rank's B is not stretched by a slow peer.

    The times are the host's: on a GPU they are when the work was issued, not when it ran (a
    loop that synchronises each step, as nanoGPT's ``loss.item()`` does, still bounds them)."""

    def __init__(self, recorder: ChunkRecorder, module: Any, throttle: Any = None) -> None:
        import torch

        self._torch = torch
        self.recorder = recorder
        # fault injection (RESIHP_THROTTLE, `resihp admin throttle`): a Throttle whose stall
        # stretches each F and B span, as behind a slower device (trainer_hooks/runtime/throttle.py)
        self.throttle = throttle
        self.stretched = False  # a span was stretched since the last step
        self.seqlens: list[tuple[int, ...]] = []  # per timed micro-batch of this iteration
        self._span: Span | None = None
        self._b_start: float | None = None  # the pending backward: first output gradient
        self._b_last: float | None = None  # ... and the latest parameter gradient accumulated
        self._handles = [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, always_call=True),
        ]
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_done)
                          for p in module.parameters() if p.requires_grad]

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._span is None:
            self.flush_backward()  # any new pass: the previous backward is over
        if self._span is not None or self.recorder.busy or not module.training \
                or not self._torch.is_grad_enabled():
            return
        self._span = self.recorder.timed("F").__enter__()
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("idx"))
        shape: tuple[int, ...] = tuple(getattr(ids, "shape", ()))
        if len(shape) == 2 and not getattr(ids, "is_floating_point", lambda: True)():
            self.seqlens.append((int(shape[1]),) * int(shape[0]))

    def _after(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if self.throttle is not None and self.throttle.factor > 1.0:
            self.throttle.stall_for(time.perf_counter() - span.start)
            self.stretched = True
        span.__exit__(None, None, None)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self._grad_begins)

    def _grad_begins(self, grad: Any) -> None:
        if self._b_start is None:
            self._b_start = time.perf_counter()
            if self.throttle is not None and self.throttle.factor > 1.0:
                # runs when the backward's gradients are all computed (before DDP's final wait)
                self._torch.autograd.Variable._execution_engine.queue_callback(self._stretch_backward)

    def _stretch_backward(self) -> None:
        start, last = self._b_start, self._b_last
        if start is not None and last is not None and self.throttle is not None:
            self.throttle.stall_for(last - start)
            self._b_last = time.perf_counter()
            self.stretched = True

    def _grad_done(self, param: Any) -> None:
        if self._b_start is not None:
            self._b_last = time.perf_counter()

    def flush_backward(self) -> None:
        """Record the backward that ran since the last forward (if one did) as a B span."""
        start, last = self._b_start, self._b_last
        self._b_start = self._b_last = None
        if start is not None and last is not None and last > start:
            self.recorder.record("B", start, last)

    def take_seqlens(self) -> tuple[tuple[int, ...], ...]:
        out = tuple(self.seqlens)
        self.seqlens = []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _tensors(output: Any) -> list[Any]:
    """The tensors among a forward's outputs: a tensor, a tuple / list of them, or a mapping
    (Hugging Face's ModelOutput)."""
    if hasattr(output, "register_hook"):
        return [output]
    if isinstance(output, dict):
        return [v for v in output.values() if hasattr(v, "register_hook")]
    if isinstance(output, (tuple, list)):
        return [v for v in output if hasattr(v, "register_hook")]
    return []
