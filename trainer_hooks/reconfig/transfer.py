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
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.reconfig.reshard import STATES, ReshardPlan, Transfer, plan_reshard
from resihp.trainer_hooks.runtime.layout import TensorSpec, shard_shape, tensors_of_rank

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


class _RankView:
    """One rank's part of a reshard plan, worked out once per (plan, rank) and cached on the
    plan: ``prepare`` runs ahead of the switch, so at the switch the executor only moves
    bytes. Per piece it avoids Python work (a switch moves hundreds of pieces, and with
    several ranks per core that work, not the wire, was most of the downtime)."""

    def __init__(self, transfers: Sequence[Transfer], rank: int, new_plan: Plan, specs: Sequence[TensorSpec]) -> None:
        self.sends: dict[int, list[Transfer]] = defaultdict(list)
        self.recvs: dict[int, list[Transfer]] = defaultdict(list)
        self.local: list[Transfer] = []
        for t in transfers:
            if t.dst == rank and t.src == rank:
                self.local.append(t)
            elif t.src == rank:
                self.sends[t.dst].append(t)
            elif t.dst == rank:
                self.recvs[t.src].append(t)
        for t in self.sends.values():
            for piece in t:
                piece.numel  # noqa: B018  (cached on the transfer: computed here, ahead of the switch)
        self.states = sorted({t.state for t in transfers})
        self.new_shapes = [(spec.name, shard_shape(idx)) for spec, idx in tensors_of_rank(new_plan, rank, specs)]
        shape_of = dict(self.new_shapes)
        arriving = [*self.local, *(t for v in self.recvs.values() for t in v)]
        # pieces that are a whole new shard need no allocation: the piece becomes the shard
        self.whole: set[tuple[str, str]] = {(t.state, t.name) for t in arriving if shape_of.get(t.name) == t.shape}
        # elements each new shard receives (checked against its size after the transfer)
        self.filled: dict[tuple[str, str], int] = defaultdict(int)
        for t in arriving:
            self.filled[(t.state, t.name)] += t.numel
        # per message (to a peer, from a peer): its pieces' byte sizes and its padded length
        self.send_sizes = {dst: [t.nbytes for t in items] for dst, items in self.sends.items()}
        self.recv_sizes = {src: [t.nbytes for t in items] for src, items in self.recvs.items()}
        self.send_length = {dst: sum(_padded(n) for n in sizes) for dst, sizes in self.send_sizes.items()}
        self.recv_length = {src: sum(_padded(n) for n in sizes) for src, sizes in self.recv_sizes.items()}
        self.send_segments = {dst: _Segments.of(sizes) for dst, sizes in self.send_sizes.items()}
        self.recv_segments = {src: _Segments.of(sizes) for src, sizes in self.recv_sizes.items()}
        # messages whose pieces are all whole words: packed and unpacked without padding
        self.send_aligned = {dst: all(t.nbytes % 8 == 0 for t in items) for dst, items in self.sends.items()}
        self.recv_aligned = {src: all(t.nbytes % 8 == 0 for t in items) for src, items in self.recvs.items()}
        self._stock: _Stock | None = None

    def stock(self, dtype: torch.dtype = torch.float32, touch: bool = True) -> None:
        """Allocate the buffers and new shards of one execution now, and the views every piece
        lands through. ``touch``: write them too (fresh memory is paged in on first write,
        which cost the switch more than the copies themselves). Held until ``take_stock``;
        the execution owns them after (received pieces become shards)."""
        if self._stock is not None:
            return
        alloc = (lambda n, dt=torch.uint8: torch.empty(n, dtype=dt).zero_()) if touch else (  # noqa: E731
            lambda n, dt=torch.uint8: torch.empty(n, dtype=dt))
        stock = _Stock(
            dtype=dtype,
            send={dst: alloc(self.send_length[dst]) for dst in self.sends},
            recv={src: alloc(self.recv_length[src]) for src in self.recvs},
            shards={(s, name): alloc(shape, dtype) for name, shape in self.new_shapes for s in self.states
                    if (s, name) not in self.whole})
        itemsize = torch.empty((), dtype=dtype).element_size()

        def target(t: Transfer) -> torch.Tensor | None:  # where a piece lands in its new shard
            return None if (t.state, t.name) in self.whole else stock.shards[(t.state, t.name)][t.dst_index]

        # every piece of an aligned message as a view of the receive buffer, with its target:
        # at the switch a piece costs one copy_ (or one dict entry when it is a whole shard)
        for src, items in self.recvs.items():
            if self.recv_aligned[src] and all(t.nbytes == t.numel * itemsize for t in items):
                views = torch.split(stock.recv[src].view(dtype), [t.numel for t in items])
                stock.landing[src] = [(t.state, t.name, v.view(t.shape), target(t)) for t, v in zip(items, views)]
        stock.local_targets = [target(t) for t in self.local]
        self._stock = stock

    def stock_sources(self, old_shards: Mapping[str, Mapping[str, torch.Tensor]], rank: int) -> None:
        """Cut, now, the pieces this rank sends or copies out of ``old_shards`` (the live
        runtime's tensors, while the command waits for its apply_at): slicing a tensor costs
        ~5-10 µs of Python per piece, and a switch has hundreds. The views see later in-place
        updates (optimizer steps); the execution uses them only if it is given the same
        tensors (same storage, shape and strides), else it cuts the pieces itself."""
        if self._stock is None:
            return
        try:
            send = {dst: [_source_piece(t, old_shards, rank) for t in items] for dst, items in self.sends.items()}
            local = [_source_piece(t, old_shards, rank) for t in self.local]
        except TransferError:
            return  # the execution raises it, with the tensors it is given
        used = sorted({(t.state, t.name) for t in [*self.local, *(t for v in self.sends.values() for t in v)]})
        held = [(s, n, _fingerprint(old_shards[s][n])) for s, n in used]
        keep = [piece.numel() == old_shards[t.state][t.name].numel() for t, piece in zip(self.local, local)]
        whole_targets = [
            torch.empty(piece.shape, dtype=piece.dtype).zero_()
            if (t.state, t.name) in self.whole and not whole_old else None
            for t, piece, whole_old in zip(self.local, local, keep)]
        self._stock.sources = _Sources(send, local, keep, held, [old_shards[s][n] for s, n in used], whole_targets)

    def take_stock(self, dtype: torch.dtype | None) -> _Stock:
        """The stock made ahead (allocated now if none was). ``dtype``: that of every shard, old
        and new; None where they differ, and then the stock's views are dropped."""
        if self._stock is None:
            self.stock(dtype or torch.float32, touch=False)
        stock, self._stock = self._stock, None
        assert stock is not None
        if stock.dtype != dtype:
            stock.landing.clear()
            stock.local_targets = []
        return stock


@dataclass
class _Stock:
    dtype: torch.dtype
    send: dict[int, torch.Tensor]
    recv: dict[int, torch.Tensor]
    shards: dict[tuple[str, str], torch.Tensor]
    # src -> per piece (state, name, its view of the receive buffer, its view of its new shard
    # or None where the piece is the whole shard)
    landing: dict[int, list[tuple[str, str, torch.Tensor, torch.Tensor | None]]] = field(default_factory=dict)
    local_targets: list[torch.Tensor | None] = field(default_factory=list)  # per local piece, as above
    sources: _Sources | None = None  # the pieces cut ahead out of the old shards

    def buffer(self, pool: dict[int, torch.Tensor], peer: int, nbytes: int) -> torch.Tensor:
        got = pool.pop(peer, None)
        return got if got is not None and got.numel() == nbytes else torch.empty(nbytes, dtype=torch.uint8)

    def shard(self, key: tuple[str, str], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        got = self.shards.pop(key, None)
        return got if got is not None and got.shape == shape and got.dtype == dtype else torch.empty(shape, dtype=dtype)


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


@dataclass
class _Sources:
    """Pieces cut ahead out of the old shards (``_RankView.stock_sources``)."""

    send: dict[int, list[torch.Tensor]]  # per destination, in plan order
    local: list[torch.Tensor]  # per local piece
    local_whole_old: list[bool]  # the local piece is its whole old tensor
    held: list[tuple[str, str, tuple[Any, ...]]]  # (state, name, fingerprint) of every old shard cut
    held_objects: list[torch.Tensor]  # those shards themselves, in the same order
    # per local piece that is a whole new shard but not its whole old tensor: a shard made
    # (and paged in) ahead to copy it into, so the piece does not pin its old tensor
    local_whole_targets: list[torch.Tensor | None]

    def still_cut_from(self, old_shards: Mapping[str, Mapping[str, torch.Tensor]]) -> bool:
        """Whether ``old_shards`` are the tensors these pieces were cut from. A cached view keeps
        its storage alive, so no other tensor can sit at the same address. The same tensor
        objects (AdamW's moments) pass at once; parameters come as fresh detached views."""
        for (state, name, fp), was in zip(self.held, self.held_objects):
            x = old_shards.get(state, {}).get(name)
            if x is None:
                return False
            if x is was:  # the same object: only a storage swap (``.data =``) could have moved it
                if x.data_ptr() != fp[0] or x.shape != fp[1]:
                    return False
            elif _fingerprint(x) != fp:
                return False
        return True


def _rank_view(plan: ReshardPlan | Sequence[Transfer], rank: int, new_plan: Plan,
               specs: Sequence[TensorSpec]) -> _RankView:
    if not isinstance(plan, ReshardPlan):
        return _RankView(tuple(plan), rank, new_plan, specs)
    cache: dict[Any, _RankView] = plan.__dict__.setdefault("_rank_views", {})  # frozen: its own memo
    key = (rank, replace(new_plan, epoch=0, reason=""), id(specs), len(specs))  # the layout, not its epoch
    view = cache.get(key)
    if view is None:
        view = cache[key] = _RankView(plan.transfers, rank, new_plan, specs)
    return view


def prepare_rank(plan: ReshardPlan, rank: int, new_plan: Plan, specs: Sequence[TensorSpec], *,
                 stock: bool = True, old_shards: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
    """Work out ``rank``'s part of ``plan`` ahead of the switch, and with ``stock`` allocate its
    buffers and new shards (``execute_reshard`` uses both); given ``old_shards`` (the tensors
    the switch will reshard from, updated in place until then), also cut its pieces out of them."""
    view = _rank_view(plan, rank, new_plan, specs)
    if stock:
        view.stock()
        if old_shards is not None:
            view.stock_sources(old_shards, rank)


def execute_reshard(
    plan: ReshardPlan | Sequence[Transfer],
    rank: int,
    old_shards: Mapping[str, Mapping[str, torch.Tensor]],
    new_plan: Plan,
    specs: Sequence[TensorSpec],
    pg: Any,
    **options: Any,
) -> Shards:
    """Send this rank's pieces, receive its new shards, verify them; return state → name → shard.
    ``start_reshard`` + ``finish``; the options are ``start_reshard``'s."""
    return start_reshard(plan, rank, old_shards, new_plan, specs, pg, **options).finish()


def start_reshard(
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
) -> ReshardInFlight:
    """Post this rank's receives, pack and post its sends, copy its local pieces; the pieces
    are then on the wire (gloo's own threads move them) until ``finish`` waits for them,
    verifies them and returns state → name → shard. In between the caller may do work that
    waits on peers rather than on the CPU (the switch creates its new groups there).

    ``pg``: a torch.distributed ProcessGroup (e.g. ``ProcessGroupGloo``) holding every rank
    named in the plan. ``dtype``: element type of shards this rank did not hold before.
    ``fault``: fault injection for tests — called on each outgoing piece (a byte view)
    after its checksum is taken. ``stats``: if given, filled with the seconds spent packing,
    sending and copying local pieces (``pack_s``), then until the wire was done (``wire_s``:
    from the end of ``start_reshard``, so it holds the caller's work in between too), and
    checking and placing what arrived (``unpack_s``).
    """
    t_start = time.perf_counter()
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, got {checksum!r}")
    rv = _rank_view(plan, rank, new_plan, specs)
    to_pg = (lambda r: r) if pg_rank_of is None else (lambda r: pg_rank_of[r])
    sends, recvs, local = rv.sends, rv.recvs, rv.local
    # the word-sum checksum of pieces of whole words, with no fault hook: one copy per message
    fast = checksum == "sum64" and fault is None

    def dtype_of(state: str, name: str) -> torch.dtype:  # a new shard keeps its old dtype
        like = old_shards.get(state, {}).get(name)
        return like.dtype if like is not None else dtype

    # the new shards (not those a single piece fills whole: that piece becomes the shard), the
    # message buffers and the pieces' landing views: made by prepare_rank where it ran, else now
    uniform = all(x.dtype == dtype for held in old_shards.values() for x in held.values())
    stock = rv.take_stock(dtype if uniform else None)
    new: Shards = {s: {} for s in rv.states}
    for name, shape in rv.new_shapes:
        for s in rv.states:
            if (s, name) not in rv.whole:
                new[s][name] = stock.shard((s, name), shape, dtype if uniform else dtype_of(s, name))

    # A dead peer can surface while a message is posted as well as while it is awaited
    # (gloo fails a recv at once if the connection is already closed): one handler for both.
    try:
        # receives first, so peers' sends find them posted; then pack and send
        works = []
        incoming: list[tuple[int, list[Transfer], torch.Tensor, torch.Tensor]] = []
        for src, items in sorted(recvs.items()):
            header = torch.empty(1 + 2 * len(items), dtype=torch.int64)
            data = stock.buffer(stock.recv, src, rv.recv_length[src])
            incoming.append((src, items, header, data))
            works.append(pg.recv([header], to_pg(src), _TAG_HEADER))
            works.append(pg.recv([data], to_pg(src), _TAG_DATA))
        keep: list[torch.Tensor] = []  # buffers must outlive their asynchronous sends
        cut = stock.sources if stock.sources is not None and stock.sources.still_cut_from(old_shards) else None
        for dst, items in sorted(sends.items()):
            data = stock.buffer(stock.send, dst, rv.send_length[dst])
            pieces = ((cut.send[dst] if cut is not None else [_source_piece(t, old_shards, rank) for t in items])
                      if fast and rv.send_aligned[dst] else [])
            if pieces and len({p.dtype for p in pieces}) == 1:
                # one copy of every piece into the buffer (whole words: no padding to zero)
                torch.cat([p.reshape(-1) for p in pieces], out=data.view(pieces[0].dtype))
                items_left: list[Transfer] = []
            else:
                items_left = items
            offset = 0
            for t in items_left:
                # each piece starts on an 8-byte word (any dtype lands aligned) and its padding
                # is zeroed, so its checksum is a wrapping sum over whole words
                piece, view = _source_piece(t, old_shards, rank), data[offset:offset + t.nbytes]
                view.view(piece.dtype).view(piece.shape).copy_(piece)  # one copy, straight into the buffer
                if t.nbytes % 8:
                    data[offset + t.nbytes:offset + _padded(t.nbytes)].zero_()
                offset += _padded(t.nbytes)
            crcs = _piece_checksums(data, items, checksum, rv.send_segments[dst])
            if fault is not None:
                offset = 0
                for t in items:
                    fault(t, data[offset:offset + t.nbytes])
                    offset += _padded(t.nbytes)
            header = torch.tensor([len(items), *rv.send_sizes[dst], *crcs], dtype=torch.int64)
            keep += [header, data]
            works.append(pg.send([header], to_pg(dst), _TAG_HEADER))
            works.append(pg.send([data], to_pg(dst), _TAG_DATA))
        # local copies overlap with the wire
        targets = stock.local_targets or [None] * len(local)
        if cut is not None:
            pieces, whole_old, whole_targets = cut.local, cut.local_whole_old, cut.local_whole_targets
        else:
            pieces = [_source_piece(t, old_shards, rank) for t in local]
            whole_old = [p.numel() == old_shards[t.state][t.name].numel() for t, p in zip(local, pieces)]
            whole_targets = [None] * len(local)
        for t, piece, target, old_whole, whole_target in zip(local, pieces, targets, whole_old, whole_targets):
            if target is not None:  # part of a new shard
                target.copy_(piece)
            elif whole_target is not None:  # a whole new shard cut from a larger old one
                whole_target.copy_(piece)
                new[t.state][t.name] = whole_target
            else:  # a whole old tensor staying whole is kept as it is (the old runtime only read it)
                _land(new, t, piece, rank, keep=old_whole, whole=(t.state, t.name) in rv.whole)
    except TransferError:
        raise
    except RuntimeError as exc:
        raise _wire_error(rank, exc) from exc
    return ReshardInFlight(rank, rv, stock, new, works, incoming, keep, timeout, checksum, dtype_of, stats,
                           t_start, time.perf_counter())


def _wire_error(rank: int, exc: RuntimeError) -> TransferError:
    # keeps the transport's words, so ulfm.is_peer_failure still recognises a dead peer
    return TransferError(
        f"rank {rank}: a point-to-point message of the reshard failed: {exc}; if a peer died, shrink and "
        "replan; a size mismatch means the ranks ran different plans"
    )


@dataclass
class ReshardInFlight:
    """A reshard whose messages are posted (``start_reshard``); ``finish`` completes it. Holds
    the send buffers, which must outlive their asynchronous sends."""

    rank: int
    rv: _RankView
    stock: _Stock
    new: Shards
    works: list[Any]
    incoming: list[tuple[int, list[Transfer], torch.Tensor, torch.Tensor]]
    keep: list[torch.Tensor]
    timeout: timedelta | None
    checksum: str
    dtype_of: Callable[[str, str], torch.dtype]
    stats: dict[str, float] | None
    t_start: float
    t_packed: float

    def finish(self) -> Shards:
        """Wait for every message, check sizes and checksums, land the pieces; the new shards."""
        rank, rv, new, dtype_of = self.rank, self.rv, self.new, self.dtype_of
        try:
            for w in self.works:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except RuntimeError as exc:
            raise _wire_error(rank, exc) from exc
        self.keep.clear()
        t_wire = time.perf_counter()
        _land_messages(rank, rv, self.stock, new, self.incoming, self.checksum, dtype_of)
        _check_filled(rank, rv, new, dtype_of)
        t_end = time.perf_counter()
        if self.stats is not None:
            self.stats.update(pack_s=self.t_packed - self.t_start, wire_s=t_wire - self.t_packed,
                              unpack_s=t_end - t_wire)
        log.debug("rank %d: reshard done, %d sends, %d receives in %.3f s", rank, len(rv.sends), len(rv.recvs),
                  t_end - self.t_start)
        return new


def _land_messages(rank: int, rv: _RankView, stock: _Stock, new: Shards,
                   incoming: Sequence[tuple[int, list[Transfer], torch.Tensor, torch.Tensor]], checksum: str,
                   dtype_of: Callable[[str, str], torch.dtype]) -> None:
    for src, items, header, data in incoming:
        sums = _piece_checksums(data, items, checksum, rv.recv_segments[src])
        _check_message(rank, src, items, header, rv.recv_sizes[src], sums, checksum)
        landing = stock.landing.get(src)
        if landing is not None:  # views made ahead: one copy_ per piece, or none for a whole shard
            for state, name, piece, target in landing:
                if target is None:
                    new[state][name] = piece
                else:
                    target.copy_(piece)
            continue
        dtypes = {dtype_of(t.state, t.name) for t in items}
        if rv.recv_aligned[src] and len(dtypes) == 1:  # one split into views, no per-piece slicing
            bufs = torch.split(data.view(dtypes.pop()), [t.numel for t in items])
            for t, buf in zip(items, bufs):
                _land(new, t, buf.view(t.shape), rank, keep=True, whole=(t.state, t.name) in rv.whole)
            continue
        offset = 0
        for t in items:
            buf = data[offset:offset + t.nbytes]
            offset += _padded(t.nbytes)
            _land(new, t, buf.view(dtype_of(t.state, t.name)).reshape(t.shape), rank, keep=True,
                  whole=(t.state, t.name) in rv.whole)


def _check_filled(rank: int, rv: _RankView, new: Shards, dtype_of: Callable[[str, str], torch.dtype]) -> None:
    for s in rv.states:
        for name, shape in rv.new_shapes:
            numel = math.prod(shape)
            if rv.filled[(s, name)] != numel or name not in new[s]:
                size = torch.empty((), dtype=dtype_of(s, name)).element_size()
                raise TransferError(
                    f"rank {rank}: the plan filled {rv.filled[(s, name)] * size} of the {numel * size} bytes of its "
                    f"new {s} of {name}; the reshard plan does not match the new plan"
                )


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


def _land(new: Shards, t: Transfer, piece: torch.Tensor, rank: int, keep: bool = False, whole: bool = False) -> None:
    """Put ``piece`` where it goes in its new shard. ``whole``: the piece is the whole new shard,
    which was not allocated; with ``keep`` (a view of the received message, or a whole old
    tensor) it becomes the shard, else a copy of it does (a slice must not pin its old tensor)."""
    if whole:
        if t.state not in new:
            raise TransferError(f"rank {rank}: the plan sends it {_where(t)}, which the new plan does not give "
                                "this rank")
        new[t.state][t.name] = piece if keep and piece.is_contiguous() else piece.clone()
        return
    try:
        target = new[t.state][t.name]
    except KeyError:
        raise TransferError(
            f"rank {rank}: the plan sends it {_where(t)}, which the new plan does not give this rank"
        ) from None
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
