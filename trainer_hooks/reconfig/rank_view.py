"""One rank's part of a reshard plan, worked out and stocked ahead of the switch.

``prepare_rank`` runs when a command arrives, before its ``apply_at``: the rank's sends and
receives per peer, its local copies and the shapes of its new shards (``_RankView``, cached on
the plan), then its message buffers and new shards, allocated and paged in (``_Stock``), and
the pieces it sends cut out of the live tensors (``_Sources``). At the switch the executor
(transfer) takes the stock and only moves bytes.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.reconfig.pieces import TransferError, _padded, _Segments, _source_piece
from resihp.trainer_hooks.reconfig.reshard import ReshardPlan, Transfer
from resihp.trainer_hooks.runtime.layout import TensorSpec, shard_shape, tensors_of_rank


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
