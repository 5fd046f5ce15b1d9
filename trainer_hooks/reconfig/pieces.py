"""A reshard's pieces on the wire: cut from the old shards, laid out on 8-byte words, checksummed.

Every piece of a message starts on a word, its padding zeroed, so the ``sum64`` checksum is
a wrapping sum over whole words; the receiver checks the sender's header (piece count, byte
sizes, checksums) against the plan and against what arrived, and ``TransferError`` names the
first piece that disagrees. Used by the executor (transfer) and the per-rank view (rank_view).
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from resihp.trainer_hooks.reconfig.reshard import Transfer


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


def _piece_checksums(data: torch.Tensor, items: Sequence[Transfer], kind: str,
                     segments: _Segments | None = None) -> list[int]:
    """The checksum of every piece of a packed buffer (pieces padded to whole words): for
    ``sum64`` one segmented sum over the buffer's words, not one call per piece (a reshard has
    hundreds of pieces; per-piece Python overhead was most of the checksum's time).
    ``segments``: the message's word layout, if worked out ahead."""
    if kind != "sum64" or not items:
        out, offset = [], 0
        for t in items:
            out.append(_checksum(data[offset:offset + _padded(t.nbytes)], kind))
            offset += _padded(t.nbytes)
        return out
    seg = segments or _Segments.of([t.nbytes for t in items])
    words = data.numpy().view(np.int64)  # the buffer is whole words; numpy sums wrap, as int64 should
    sums = np.add.reduceat(words, seg.starts) if words.size else np.zeros(len(items), dtype=np.int64)
    if seg.empty:  # reduceat gives a one-word "sum" for an empty piece: empty pieces sum to 0
        sums[seg.empty] = 0
    return sums.tolist()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Segments:
    """Where each piece of a message starts, in 8-byte words, and which pieces are empty."""

    starts: Any  # np.ndarray of int64
    empty: list[int]

    @staticmethod
    def of(sizes: Sequence[int]) -> _Segments:
        starts = np.cumsum([0] + [_padded(n) // 8 for n in sizes[:-1]])
        return _Segments(starts, [i for i, n in enumerate(sizes) if n == 0])


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
    # the whole shard is the common case (layers moving whole, replicas copying): no slicing;
    # slicing clamps, so a shard too small gives a piece of the wrong shape
    piece = shard if shard.shape == t.shape else shard[t.src_index]
    if piece.shape != t.shape:
        raise TransferError(
            f"rank {rank}: its {t.state} of {t.name} has shape {tuple(shard.shape)}, too small for the piece "
            f"{_where(t)}; the old plan given to the planner is not the layout this rank holds"
        )
    if t.numel * piece.element_size() != t.nbytes:
        raise TransferError(
            f"rank {rank}: {_where(t)} is {t.numel * piece.element_size()} bytes as {piece.dtype}, the plan "
            f"says {t.nbytes}; plan with the itemsize of the tensors actually held"
        )
    return piece


def _check_message(rank: int, src: int, items: Sequence[Transfer], header: torch.Tensor, sizes: Sequence[int],
                   sums: Sequence[int], checksum: str) -> None:
    """The sender's header against the plan (piece count and sizes) and against the checksums
    of what arrived; names the first piece that disagrees."""
    count = int(header[0])
    if count != len(items):
        raise TransferError(
            f"rank {rank}: rank {src} sent {count} pieces, the plan says {len(items)}; all ranks must execute "
            "the same reshard plan"
        )
    got_sizes, crcs = header[1:1 + count].tolist(), header[1 + count:].tolist()
    if got_sizes != list(sizes):
        i = next(i for i, (a, b) in enumerate(zip(got_sizes, sizes)) if a != b)
        raise TransferError(
            f"rank {rank}: piece {i} from rank {src} ({_where(items[i])}) is {got_sizes[i]} bytes, expected {sizes[i]}"
        )
    if crcs != list(sums):
        i = next(i for i, (a, b) in enumerate(zip(sums, crcs)) if a != b)
        raise TransferError(
            f"rank {rank}: piece {i} from rank {src} ({_where(items[i])}) fails its checksum: {checksum} "
            f"{sums[i]:#x}, sender computed {int(crcs[i]):#x}; it was corrupted in transit — redo the "
            "reshard or recover from a checkpoint"
        )
