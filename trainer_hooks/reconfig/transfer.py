"""Transfer executor: run a reshard plan with point-to-point messages on a process group.

Every rank calls ``execute_reshard`` with the same plan. Pieces one rank sends to another
are packed, in plan order, into ONE byte buffer per (sender, receiver) pair, preceded by a
small header (piece count, byte sizes, CRC-32 of every piece). Receivers check sizes and
checksums against the sender's before a piece lands in a new shard, so a wrong plan, a
dtype mismatch or corruption in transit is an error that names the tensor, never silent.

Plans speak *logical* ranks (a rank's identity for the whole job); after a shrink the
process group numbers survivors 0..n-1, so ``pg_rank_of`` maps one to the other.

The pieces' word layout, checksums and header checks are in ``reconfig.pieces``; the work
done per rank ahead of the switch (``prepare_rank``) in ``reconfig.rank_view``.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.reconfig.pieces import (
    CHECKSUMS,
    TransferError,
    _check_message,
    _padded,
    _piece_checksums,
    _source_piece,
    _where,
)
from resihp.trainer_hooks.reconfig.rank_view import _rank_view, _RankView, _Stock
from resihp.trainer_hooks.reconfig.reshard import STATES, ReshardPlan, Transfer, plan_reshard
from resihp.trainer_hooks.runtime.layout import TensorSpec

log = logging.getLogger(__name__)

Shards = dict[str, dict[str, torch.Tensor]]  # state -> tensor name -> local shard
FaultHook = Callable[[Transfer, torch.Tensor], None]

_TAG_HEADER = 7301
_TAG_DATA = 7302


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
