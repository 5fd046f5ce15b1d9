"""Transfer executor: run a reshard plan with point-to-point messages on a process group.

Every rank calls ``execute_reshard`` with the same plan. Pieces one rank sends to another
are packed, in plan order, into ONE byte buffer per (sender, receiver) pair, preceded by a
small header (piece count, byte sizes, CRC-32 of every piece). Receivers check sizes and
checksums against the sender's before a piece lands in a new shard, so a wrong plan, a
dtype mismatch or corruption in transit is an error that names the tensor, never silent.

Plans speak *logical* ranks (a rank's identity for the whole job); after a shrink the
process group numbers survivors 0..n-1, so ``pg_rank_of`` maps one to the other.
"""
from __future__ import annotations

import logging
import time
import zlib
from collections import defaultdict
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from resihp.coordinator.plan import Plan
from resihp.trainer_hooks.layout import TensorSpec, shard_shape, tensors_of_rank
from resihp.trainer_hooks.reshard import STATES, ReshardPlan, Transfer, plan_reshard

log = logging.getLogger(__name__)

Shards = dict[str, dict[str, torch.Tensor]]  # state -> tensor name -> local shard
FaultHook = Callable[[Transfer, torch.Tensor], None]

_TAG_HEADER = 7301
_TAG_DATA = 7302


class TransferError(RuntimeError):
    """A piece was missing, of the wrong size, or failed its checksum. The new shards are
    unusable: redo the reshard (a transient fault) or recover from a checkpoint."""


def _where(t: Transfer) -> str:
    return f"{t.state} of {t.name}[{', '.join(f'{s.start}:{s.stop}' for s in t.index)}]"


CHECKSUMS = ("sum64", "crc32")


def _checksum(buf: torch.Tensor, kind: str) -> int:
    """Checksum of a byte tensor. ``sum64``: the wrapping sum of its 8-byte words (any one
    flipped bit changes it; ~10x faster than zlib's crc32, which runs below loopback
    bandwidth); bytes outside the aligned words are summed apart with their own weight."""
    if kind == "crc32":
        return zlib.crc32(buf.numpy().data) & 0xFFFFFFFF
    n, off = buf.numel(), buf.storage_offset()
    head = min(n, -off % 8)
    body = (n - head) // 8 * 8
    total = int(buf[head:head + body].view(torch.int64).sum()) if body else 0
    if body != n:  # the executor pads pieces to aligned words, so it never pays for this part
        rest = torch.cat([buf[:head], buf[head + body:]]).to(torch.int64)
        total += int((rest * torch.arange(1, rest.numel() + 1)).sum()) * 0x9E3779B1
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)  # back into int64 range for the header


def _piece_checksums(data: torch.Tensor, items: Sequence[Transfer], kind: str) -> list[int]:
    """The checksum of every piece of a packed buffer (pieces padded to whole words): for
    ``sum64`` one segmented sum over the buffer's words, not one call per piece (a reshard has
    hundreds of pieces; per-piece Python overhead was most of the checksum's time)."""
    if kind != "sum64" or not items:
        out, offset = [], 0
        for t in items:
            out.append(_checksum(data[offset:offset + _padded(t.nbytes)], kind))
            offset += _padded(t.nbytes)
        return out
    words = data.numpy().view(np.int64)  # the buffer is whole words; numpy sums wrap, as int64 should
    starts = np.cumsum([0] + [_padded(t.nbytes) // 8 for t in items[:-1]])
    sums = np.add.reduceat(words, starts) if words.size else np.zeros(len(items), dtype=np.int64)
    # reduceat gives a one-word "sum" for an empty piece: empty pieces sum to 0
    sums[[i for i, t in enumerate(items) if t.nbytes == 0]] = 0
    return [int(x) for x in sums]


def _padded(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def _source_piece(t: Transfer, old: Mapping[str, Mapping[str, torch.Tensor]], rank: int) -> torch.Tensor:
    try:
        shard = old[t.state][t.name]
    except KeyError:
        raise TransferError(
            f"rank {rank}: the plan has it send {_where(t)} but it holds no {t.state} of {t.name}; "
            "old_shards must hold every tensor the old plan gave this rank"
        ) from None
    piece = shard[t.src_index]  # slicing clamps: a shard too small gives a piece of the wrong shape
    if piece.shape != t.shape:
        raise TransferError(
            f"rank {rank}: its {t.state} of {t.name} has shape {tuple(shard.shape)}, too small for the piece "
            f"{_where(t)}; the old plan given to the planner is not the layout this rank holds"
        )
    if piece.numel() * piece.element_size() != t.nbytes:
        raise TransferError(
            f"rank {rank}: {_where(t)} is {piece.numel() * piece.element_size()} bytes as {piece.dtype}, the plan "
            f"says {t.nbytes}; plan with the itemsize of the tensors actually held"
        )
    return piece


def execute_reshard(
    plan: ReshardPlan | Sequence[Transfer],
    rank: int,
    old_shards: Mapping[str, Mapping[str, torch.Tensor]],
    new_plan: Plan,
    specs: Sequence[TensorSpec],
    pg: Any,
    *,
    pg_rank_of: Mapping[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    timeout: timedelta | None = None,
    fault: FaultHook | None = None,
    stats: dict[str, float] | None = None,
    checksum: str = "sum64",
) -> Shards:
    """Send this rank's pieces, receive its new shards, verify them; return state → name → shard.

    ``pg``: a torch.distributed ProcessGroup (e.g. ``ProcessGroupGloo``) holding every rank
    named in the plan. ``dtype``: element type of shards this rank did not hold before.
    ``fault``: fault injection for tests — called on each outgoing piece (a byte view)
    after its checksum is taken. ``stats``: if given, filled with the seconds spent packing,
    sending and copying local pieces (``pack_s``), then waiting for the wire (``wire_s``), and
    checking and placing what arrived (``unpack_s``).
    """
    t_start = time.perf_counter()
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, got {checksum!r}")
    transfers = plan.transfers if isinstance(plan, ReshardPlan) else tuple(plan)
    to_pg = (lambda r: r) if pg_rank_of is None else (lambda r: pg_rank_of[r])
    states = sorted({t.state for t in transfers})

    # allocate the new shards
    new: Shards = {s: {} for s in states}
    for spec, idx in tensors_of_rank(new_plan, rank, specs):
        for s in states:
            like = old_shards.get(s, {}).get(spec.name)
            new[s][spec.name] = torch.empty(shard_shape(idx), dtype=like.dtype if like is not None else dtype)
    covered: dict[tuple[str, str], int] = defaultdict(int)

    sends: dict[int, list[Transfer]] = defaultdict(list)
    recvs: dict[int, list[Transfer]] = defaultdict(list)
    local: list[Transfer] = []
    for t in transfers:
        if t.dst == rank and t.src == rank:
            local.append(t)
        elif t.src == rank:
            sends[t.dst].append(t)
        elif t.dst == rank:
            recvs[t.src].append(t)

    # A dead peer can surface while a message is posted as well as while it is awaited
    # (gloo fails a recv at once if the connection is already closed): one handler for both.
    try:
        # receives first, so peers' sends find them posted; then pack and send
        works = []
        incoming: list[tuple[int, list[Transfer], torch.Tensor, torch.Tensor]] = []
        for src, items in sorted(recvs.items()):
            header = torch.empty(1 + 2 * len(items), dtype=torch.int64)
            data = torch.empty(sum(_padded(t.nbytes) for t in items), dtype=torch.uint8)
            incoming.append((src, items, header, data))
            works.append(pg.recv([header], to_pg(src), _TAG_HEADER))
            works.append(pg.recv([data], to_pg(src), _TAG_DATA))
        keep: list[torch.Tensor] = []  # buffers must outlive their asynchronous sends
        for dst, items in sorted(sends.items()):
            data = torch.empty(sum(_padded(t.nbytes) for t in items), dtype=torch.uint8)
            offset = 0
            for t in items:
                # each piece starts on an 8-byte word (any dtype lands aligned) and its padding
                # is zeroed, so its checksum is a wrapping sum over whole words
                piece, view = _source_piece(t, old_shards, rank), data[offset:offset + t.nbytes]
                view.view(piece.dtype).view(piece.shape).copy_(piece)  # one copy, straight into the buffer
                if t.nbytes % 8:
                    data[offset + t.nbytes:offset + _padded(t.nbytes)].zero_()
                offset += _padded(t.nbytes)
            crcs = _piece_checksums(data, items, checksum)
            if fault is not None:
                offset = 0
                for t in items:
                    fault(t, data[offset:offset + t.nbytes])
                    offset += _padded(t.nbytes)
            header = torch.tensor([len(items)] + [t.nbytes for t in items] + crcs, dtype=torch.int64)
            keep += [header, data]
            works.append(pg.send([header], to_pg(dst), _TAG_HEADER))
            works.append(pg.send([data], to_pg(dst), _TAG_DATA))
        # local copies overlap with the wire
        for t in local:
            piece = _source_piece(t, old_shards, rank)
            # a whole old tensor staying whole is kept as it is (the old runtime only read it)
            _land(new, t, piece, rank, keep=piece.numel() == old_shards[t.state][t.name].numel())
            covered[(t.state, t.name)] += t.nbytes
        t_packed = time.perf_counter()
        for w in works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
    except TransferError:
        raise
    except RuntimeError as exc:
        # keeps the transport's words, so ulfm.is_peer_failure still recognises a dead peer
        raise TransferError(
            f"rank {rank}: a point-to-point message of the reshard failed: {exc}; if a peer died, shrink and "
            "replan; a size mismatch means the ranks ran different plans"
        ) from exc

    t_wire = time.perf_counter()
    for src, items, header, data in incoming:
        count = int(header[0])
        if count != len(items):
            raise TransferError(
                f"rank {rank}: rank {src} sent {count} pieces, the plan says {len(items)}; all ranks must execute "
                "the same reshard plan"
            )
        sizes, crcs = header[1:1 + count].tolist(), header[1 + count:].tolist()
        for i, t in enumerate(items):
            if sizes[i] != t.nbytes:
                raise TransferError(
                    f"rank {rank}: piece {i} from rank {src} ({_where(t)}) is {sizes[i]} bytes, expected {t.nbytes}"
                )
        sums = _piece_checksums(data, items, checksum)
        offset = 0
        for i, t in enumerate(items):
            buf = data[offset:offset + t.nbytes]
            got = sums[i]
            offset += _padded(t.nbytes)
            if got != crcs[i]:
                raise TransferError(
                    f"rank {rank}: piece {i} from rank {src} ({_where(t)}) fails its checksum: {checksum} {got:#x}, "
                    f"sender computed {int(crcs[i]):#x}; it was corrupted in transit — redo the reshard or "
                    "recover from a checkpoint"
                )
            target = new[t.state][t.name]
            _land(new, t, buf.view(target.dtype).reshape(t.shape), rank, keep=True)
            covered[(t.state, t.name)] += t.nbytes

    for s, by_name in new.items():
        for name, shard in by_name.items():
            want = shard.numel() * shard.element_size()
            if covered[(s, name)] != want:
                raise TransferError(
                    f"rank {rank}: the plan filled {covered[(s, name)]} of the {want} bytes of its new {s} of {name}; "
                    "the reshard plan does not match the new plan"
                )
    t_end = time.perf_counter()
    if stats is not None:
        stats.update(pack_s=t_packed - t_start, wire_s=t_wire - t_packed, unpack_s=t_end - t_wire)
    log.debug("rank %d: reshard done, %d sends, %d receives in %.3f s", rank, len(sends), len(recvs), t_end - t_start)
    return new


def _land(new: Shards, t: Transfer, piece: torch.Tensor, rank: int, keep: bool = False) -> None:
    """Put ``piece`` where it goes in its new shard. ``keep``: when the piece is the whole new
    shard, it becomes the shard (a view of the received message, or an old tensor): no copy."""
    try:
        target = new[t.state][t.name]
    except KeyError:
        raise TransferError(
            f"rank {rank}: the plan sends it {_where(t)}, which the new plan does not give this rank"
        ) from None
    if keep and piece.shape == target.shape and piece.dtype == target.dtype and piece.is_contiguous():
        new[t.state][t.name] = piece  # a piece of the shard's whole shape is the whole shard
    else:
        target[t.dst_index] = piece


def reshard_state(
    old_plan: Plan,
    new_plan: Plan,
    specs: Sequence[TensorSpec],
    rank: int,
    old_shards: Mapping[str, Mapping[str, torch.Tensor]],
    pg: Any,
    *,
    alive: Sequence[int],
    node_of: Mapping[int, str] | None = None,
    pg_rank_of: Mapping[int, int] | None = None,
    states: Sequence[str] = STATES,
    itemsize: int | Mapping[str, int] = 4,
    **options: Any,
) -> tuple[Shards, ReshardPlan]:
    """Plan and execute in one call; every rank computes the same plan (the planner is
    deterministic). ``options`` go to ``execute_reshard`` (timeout, checksum, stats, ...).
    Raises ``ReshardError`` before any message is sent if some needed state is lost."""
    plan = plan_reshard(old_plan, new_plan, specs, alive, node_of, states=states, itemsize=itemsize)
    new = execute_reshard(plan, rank, old_shards, new_plan, specs, pg, pg_rank_of=pg_rank_of, **options)
    return new, plan
