"""The 1F1B pipeline schedule with real point-to-point sends between stages.

Stage s of p runs ``min(p − s − 1, M)`` warm-up forwards, then alternates one forward and
one backward, then drains the remaining backwards (PipeDream-flush / Megatron 1F1B). Sends
are non-blocking (``isend``; completed at the end of the step), receives block, so two
neighbours sending to each other at once cannot deadlock. Every forward (F), backward (B)
and inbound transfer (P2P: the payload's transfer from the sender's post time, not the
wait for the sender; see ``_recv``) is recorded with its micro-batch index; with 1F1B B
covers both the input and the weight gradient (no separate W).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resihp.trainer_hooks.reporting.opcursor import CURSOR
from resihp.trainer_hooks.runtime.chunk_clock import HostClock, SpanClock
from resihp.trainer_hooks.runtime.data import ReplicaBatch
from resihp.trainer_hooks.runtime.groups import StagePlace
from resihp.trainer_hooks.runtime.model import GPTStage, PackedMeta, loss_sum
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.tp_layers import collective_seconds, cuda_spans_mark, take_cuda_spans


@dataclass
class ChunkLog:
    """Timed chunks of one rank in one iteration: (kind, microbatch, chunk, start_s, end_s),
    times in seconds from the rank's iteration start (``clock.t0``). ``add`` takes host
    ``perf_counter`` readings; ``add_marks`` takes marks of ``clock`` (chunk_clock.py): on a
    CPU they are host readings too and land at once, on a GPU they are CUDA events, placed
    where they were added once ``finish`` has waited for the device."""

    clock: SpanClock = field(default_factory=HostClock)
    chunks: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    # spans still waiting for their events: (index in chunks, kind, microbatch, chunk, start, end,
    # the (before, after) marks of the TP collectives inside the op)
    _marked: list[tuple[int, str, int, int, Any, Any, tuple[tuple[Any, Any], ...]]] = field(default_factory=list)

    @property
    def t0(self) -> float:
        return self.clock.t0

    def add(self, kind: str, microbatch: int, start: float, end: float, chunk: int = 0) -> None:
        self.chunks.append((kind, microbatch, chunk, start - self.t0, end - self.t0))

    def add_marks(self, kind: str, microbatch: int, start: Any, end: Any, chunk: int = 0,
                  inside: Sequence[tuple[Any, Any]] = ()) -> None:
        """The span between two marks of ``clock``. ``inside``: the mark pairs of the TP
        collectives the op ran, recorded as one ``TP`` chunk of their total that ends where
        the op ends (docs/trace-format.md)."""
        entry = (len(self.chunks), kind, microbatch, chunk, start, end, tuple(inside))
        if self.clock.immediate:
            self.chunks += self._place(entry)
        else:
            self._marked.append(entry)

    def _place(self, entry: tuple[int, str, int, int, Any, Any, tuple[tuple[Any, Any], ...]]
               ) -> list[tuple[str, int, int, float, float]]:
        _, kind, mb, chunk, start, end, inside = entry
        s, e = self.clock.seconds(start), self.clock.seconds(end)
        rows = [(kind, mb, chunk, s, e)]
        if inside:
            waited = sum(self.clock.seconds(b) - self.clock.seconds(a) for a, b in inside)
            rows.append(("TP", mb, chunk, e - min(max(waited, 0.0), e - s), e))
        return rows

    def finish(self) -> float:
        """Wait for the device and place every marked span; the step's time (host seconds since t0)."""
        took = self.clock.settle()
        if self._marked:
            out = list(self.chunks)
            for entry in reversed(self._marked):  # from the last, so earlier indexes still hold
                out[entry[0]:entry[0]] = self._place(entry)
            self.chunks, self._marked = out, []
        return took

    def total(self, kind: str) -> float:
        return sum(e - s for k, _, _, s, e in self.chunks if k == kind)


def schedule_1f1b(num_stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of ("F", i) / ("B", i) steps stage ``stage`` runs."""
    warmup = min(num_stages - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return order


class PipelineStep:
    """Runs one iteration's micro-batches through this rank's stage."""

    def __init__(self, stage: GPTStage, place: StagePlace, device: torch.device, throttle: Throttle,
                 peer_groups: Mapping[int, Any], compute_clock: str = "wall",
                 watch: Callable[[], None] | None = None) -> None:
        """``peer_groups``: neighbour rank → the process group to reach it on
        (``EpochGroups.peer_groups``, held, not copied: ``sever`` empties it). ``compute_clock``
        "auto": CPU time on a CPU device, CUDA events on a GPU (TrainConfig.compute_clock).
        ``watch``: called before every op; raises to end the step (reporting.deaths.DeathWatch)."""
        if compute_clock not in ("auto", "wall", "cpu"):
            raise ValueError(f"compute_clock must be 'auto', 'wall' or 'cpu', got {compute_clock!r}")
        if compute_clock == "cpu" and device.type == "cuda":
            raise ValueError("compute_clock 'cpu' times CPU ops in the host thread's CPU time; a GPU's ops are "
                             "timed by CUDA events: use compute_clock 'wall'")
        if compute_clock == "auto":
            compute_clock = "wall" if device.type == "cuda" else "cpu"
        self.stage = stage
        self.place = place
        self.device = device
        self.throttle = throttle
        self.compute_clock = compute_clock
        self.peer_groups = peer_groups
        self.watch = watch or (lambda: None)
        self._pending: list[Any] = []  # outstanding isend works (and the tensors they read)

    def _group(self, peer: int) -> Any:
        group = self.peer_groups.get(peer)
        if group is None:
            raise RuntimeError(f"pipeline: no process group for neighbour rank {peer}; this epoch's groups "
                               f"were torn down (a peer failed or the plan changed)")
        return group

    def _recv(self, src: int, shape: tuple[int, ...], tag: int, log: ChunkLog, mb: int) -> torch.Tensor:
        """Receive a tensor; the P2P chunk is its transfer alone. The sender appends the wall
        time it posted the send (``_send``): the transfer is the arrival less the later of that
        and this receive's start — the wait for a sender still computing is the schedule's,
        not the link's, and the link is what the detector judges by. A receive that starts
        late finds the payload arrived and records next to nothing: a transfer hidden behind
        compute costs nothing. (A constant clock offset between two nodes is a constant the
        detector's per-link calibration absorbs.)"""
        rows, cols = shape
        framed = torch.empty((rows + 1, cols), dtype=torch.float32, device=self.device)
        before = log.clock.mark()
        with CURSOR.op("p2p", f"recv {'F' if tag % 2 == 0 else 'B'} mb{mb} from {src}"):
            dist.recv(framed, src=src, tag=tag, group=self._group(src))
        end = time.perf_counter()
        sent = float(framed[rows, :2].to("cpu").clone().view(torch.float64)[0])
        if self.device.type == "cuda":
            # the copy above waited for the receive; the receive started when the stream
            # reached it (the op before it done), not when the host queued it. The sender's
            # post time is when its host queued the send, which on a GPU can be before the
            # op producing the payload ends: there a P2P chunk may hold that op's tail
            end = time.perf_counter()
        start = log.t0 + log.clock.seconds(before)
        took = max(0.0, min(end - start, time.time() - sent))
        log.add("P2P", mb, end - took, end)
        return framed[:rows]

    def _send(self, tensor: torch.Tensor, dsts: tuple[int, ...], tag: int) -> None:
        rows, cols = tensor.shape
        framed = torch.empty((rows + 1, cols), dtype=torch.float32, device=self.device)
        framed[:rows].copy_(tensor.detach())
        # the post time as float64 bits in two float32 slots of one extra row (the receiver
        # slices it off): no second message, whose latency cost 25-40 % of a PP4 step on CPU
        framed[rows, :2].copy_(torch.tensor([time.time()], dtype=torch.float64).view(torch.float32))
        for dst in dsts:
            self._pending.append((dist.isend(framed, dst=dst, tag=tag, group=self._group(dst)), framed))

    def _compute(self, fn: Callable[[], Any], kind: str, mb: int, log: ChunkLog) -> Any:
        with CURSOR.op("compute", f"{kind} mb{mb}"):
            return self._compute_timed(fn, kind, mb, log)

    def _compute_timed(self, fn: Callable[[], Any], kind: str, mb: int, log: ChunkLog) -> Any:
        if self.device.type == "cuda":
            return self._compute_on_gpu(fn, kind, mb, log)
        if self.compute_clock == "cpu":
            # CPU-time durations (placed at the chunk's wall start), the CPU's device time: on
            # cores shared with other ranks or jobs a chunk's CPU time barely moves when they
            # take the core, its wall time does. A throttle plays a slower device as on a GPU:
            # the op lasts factor x its own time, and the host waits out the extra without
            # burning the core (a spinning stall would take it from co-located ranks, whose
            # transfers would then look slow); the extra counts in the op's recorded time.
            start, cpu0 = time.perf_counter(), time.thread_time()
            out = fn()
            used = time.thread_time() - cpu0
            stalled = self.throttle.stall_for(used)
            log.add(kind, mb, start, start + used + stalled)
            return out
        start, waited0 = time.perf_counter(), collective_seconds()
        out = fn()
        self.throttle.stall_for(time.perf_counter() - start)
        end = time.perf_counter()
        log.add(kind, mb, start, end)
        waited = collective_seconds() - waited0
        if waited > 0.0 and self.device.type == "cpu":
            # the op's time inside TP all-reduces, as one span ending with the op (they are
            # interleaved with its compute; only the duration means anything): a partner
            # that waits for a slow member spends its op there (docs/trace-format.md)
            log.add("TP", mb, end - waited, end)
        return out

    def _compute_on_gpu(self, fn: Callable[[], Any], kind: str, mb: int, log: ChunkLog) -> Any:
        """The op between two events on the compute stream (chunk_clock.py), its TP
        collectives' events inside it. A throttle waits for the op's kernels, then stalls
        the host while the device has nothing queued, so the op really takes factor × its
        device time (a stall on the host alone would only delay the launch of work the GPU
        had not reached yet)."""
        clock = log.clock
        first = cuda_spans_mark()
        start = clock.mark()
        out = fn()
        end = clock.mark()
        if self.throttle.factor > 1.0:
            clock.wait(end)
            self.throttle.stall_for(clock.seconds(end) - clock.seconds(start))
            end = clock.mark()  # the stall counts, as on a CPU
        log.add_marks(kind, mb, start, end, inside=take_cuda_spans(first))
        return out

    def run(self, batch: ReplicaBatch, log: ChunkLog) -> torch.Tensor | None:
        """Forward and backward every micro-batch; returns this replica's summed loss on the last stage."""
        place = self.place
        mbs = batch.microbatches
        hidden = self.stage.spec.hidden
        norm = float(batch.global_tokens)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_total = torch.zeros((), dtype=torch.float32, device=self.device) if place.last else None
        for kind, i in schedule_1f1b(place.num_stages, place.stage, len(mbs)):
            self.watch()
            mb = mbs[i]
            if kind == "F":
                meta = PackedMeta.from_seqlens(mb.seqlens, self.device)
                if place.first:
                    x_in: torch.Tensor | None = None
                    x = mb.tokens.to(self.device)
                else:
                    assert place.recv_fwd_from is not None
                    x_in = self._recv(place.recv_fwd_from, (mb.num_tokens, hidden), 2 * i, log, i)
                    x_in.requires_grad_(True)
                    x = x_in

                def forward(x: torch.Tensor = x, meta: PackedMeta = meta) -> torch.Tensor:
                    out = self.stage(x, meta)
                    if place.last:
                        return loss_sum(out, mb.targets.to(self.device)) / norm
                    return out

                out = self._compute(forward, "F", i, log)
                if place.last:
                    assert loss_total is not None
                    loss_total += out.detach()
                else:
                    self._send(out, place.send_fwd_to, 2 * i)
                saved[i] = (x_in, out)
            else:
                x_in, out = saved.pop(i)
                if place.last:
                    grad = None
                else:
                    assert place.recv_bwd_from is not None
                    grad = self._recv(place.recv_bwd_from, tuple(out.shape), 2 * i + 1, log, i)
                self._compute(lambda: torch.autograd.backward(out, grad), "B", i, log)
                if x_in is not None:
                    assert x_in.grad is not None
                    self._send(x_in.grad, place.send_bwd_to, 2 * i + 1)
        return loss_total

    def abandon(self) -> list[Any]:
        """Take the outstanding sends out of this step and return them, unfinished (after a
        failure). An isend's work holds its group's transport context in C++, so while it
        lives the connection stays open even once the group object is gone, and a neighbour
        blocked in a receive from this rank waits out its timeout."""
        pending, self._pending = self._pending, []
        return pending

    def finish_sends(self, log: ChunkLog) -> None:
        start = log.clock.mark()
        with CURSOR.op("p2p", "send wait"):
            for work, _ in self._pending:
                work.wait()
        if self._pending:
            log.add_marks("P2P", -1, start, log.clock.mark())
        self._pending.clear()
