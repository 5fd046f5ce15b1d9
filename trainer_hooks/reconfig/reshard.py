"""Reshard planner: old Plan + new Plan → the transfers that rebuild every new shard.

Every tensor of the model (TensorSpec) is split, if at all, along one dimension (its TP
dimension), so every shard is an interval on that axis. For each shard a rank must hold
under the new plan, and for each optimizer state, the planner covers the interval exactly
once with pieces of shards alive ranks hold under the old plan:

1. the part the destination already holds is a local copy (src == dst, no bytes moved);
2. every remaining elementary piece (cut at the old holders' boundaries) goes to a source
   on the destination's node if one holds it, else anywhere;
3. among equal candidates the one that has sent the fewest bytes so far wins, pieces taken
   largest first (LPT), which keeps the largest per-rank send volume low.

Shards whose holders are dead come from a surviving data-parallel replica; if no alive
rank holds some piece, ``ReshardError`` names it and the caller falls back to a checkpoint.

Pure: no torch, grpc or MPI; deterministic for equal inputs.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.layout import Index, TensorSpec, check_plan_fits, tensors_of_rank

STATES: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")  # AdamW's (runtime/optim.py: any optimizer's)


class ReshardError(SpecError):
    """No alive rank holds some piece of state the new plan needs: recover from a checkpoint."""

    def __init__(self, message: str, missing: Sequence[tuple[str, str, Index]]) -> None:
        super().__init__(message)
        self.missing = list(missing)  # (tensor name, state, global index)


@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``index`` (global) of state ``state`` of tensor ``name`` to ``dst``.

    ``src_index`` indexes the sender's old shard, ``dst_index`` the receiver's new shard.
    ``src == dst`` is a local copy.
    """

    src: int
    dst: int
    name: str
    state: str
    index: Index
    src_index: Index
    dst_index: Index
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    @cached_property
    def shape(self) -> tuple[int, ...]:  # cached: the executor asks for it per piece, per switch
        return tuple(s.stop - s.start for s in self.index)

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src, "dst": self.dst, "name": self.name, "state": self.state,
            "index": [[s.start, s.stop] for s in self.index], "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class ReshardPlan:
    transfers: tuple[Transfer, ...]
    bytes_moved: int  # over the network (src != dst)
    bytes_local: int  # copied in place (src == dst)
    send_bytes: dict[int, int] = field(default_factory=dict)  # per rank, remote only
    recv_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def bytes_needed(self) -> int:
        """Every byte of every new shard (local + moved)."""
        return self.bytes_moved + self.bytes_local

    @property
    def max_send_bytes(self) -> int:
        return max(self.send_bytes.values(), default=0)

    def for_rank(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank or t.dst == rank]

    def pairs(self) -> set[tuple[int, int]]:
        return {(t.src, t.dst) for t in self.transfers if not t.is_local}

    def summary(self) -> str:
        mib = 1 << 20
        return (
            f"{len(self.transfers)} transfers over {len(self.pairs())} rank pairs: "
            f"{self.bytes_moved / mib:.2f} MiB moved, {self.bytes_local / mib:.2f} MiB local, "
            f"max sent by one rank {self.max_send_bytes / mib:.2f} MiB"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_moved": self.bytes_moved, "bytes_local": self.bytes_local,
            "send_bytes": {str(k): v for k, v in sorted(self.send_bytes.items())},
            "recv_bytes": {str(k): v for k, v in sorted(self.recv_bytes.items())},
            "transfers": [t.to_dict() for t in self.transfers],
        }


@dataclass(frozen=True)
class _Piece:
    """A remote interval [lo, hi) of one state of one tensor that ``dst`` needs."""

    dst: int
    spec: TensorSpec
    state: str
    lo: int
    hi: int
    dst_start: int  # where dst's new shard begins on the split axis
    candidates: tuple[tuple[int, int], ...]  # (holder rank, holder shard start)


def _axis(spec: TensorSpec) -> int:
    # unsplit tensors are one interval [0, shape[0]) on axis 0: every holder holds all of it
    return 0 if spec.tp_dim is None else spec.tp_dim


def _global(spec: TensorSpec, lo: int, hi: int, offset: int = 0) -> Index:
    return _index(spec.shape, _axis(spec), lo - offset, hi - offset)


@lru_cache(maxsize=4096)
def _index(shape: tuple[int, ...], axis: int, lo: int, hi: int) -> Index:
    # memoised: a plan asks for the same few indices thousands of times (3 per transfer), and
    # a tuple of slices is immutable, so every transfer may share one
    return tuple(slice(lo, hi) if d == axis else slice(0, n) for d, n in enumerate(shape))


def _nbytes(spec: TensorSpec, lo: int, hi: int, itemsize: int) -> int:
    return spec.numel // spec.shape[_axis(spec)] * (hi - lo) * itemsize


def plan_reshard(
    old: Plan,
    new: Plan,
    specs: Sequence[TensorSpec],
    alive: Iterable[int],
    node_of: Mapping[int, str] | None = None,
    *,
    states: Sequence[str] = STATES,
    itemsize: int | Mapping[str, int] = 4,
) -> ReshardPlan:
    """The transfers that give every rank of ``new`` its shards of every state in ``states``.

    ``alive``: ranks that can send (old holders outside it are lost). ``node_of``: rank →
    node name, for preferring same-node sources (None: no preference). ``itemsize``: bytes
    per element, one for all states or per state.
    """
    alive_set = set(alive)
    check_plan_fits(old, specs)
    check_plan_fits(new, specs)
    dead_dst = sorted(set(new.ranks()) - alive_set)
    if dead_dst:
        raise SpecError(f"reshard: the new plan gives work to ranks {dead_dst}, which are not alive; plan around them")
    if not states or states[0] != "param" or len(set(states)) != len(states):
        raise SpecError(f"reshard: states must be 'param' and then the optimizer's per-parameter tensors, each once "
                        f"(AdamW: {list(STATES)}), got {list(states)}")
    sizes = {s: (itemsize if isinstance(itemsize, int) else itemsize[s]) for s in states}
    nodes = dict(node_of or {})

    # alive old holders of every tensor: name -> [(rank, lo, hi)]
    holders: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    lost: dict[str, list[int]] = defaultdict(list)
    for rank in old.ranks():
        for spec, idx in tensors_of_rank(old, rank, specs):
            sl = idx[_axis(spec)]
            if rank in alive_set:
                holders[spec.name].append((rank, sl.start, sl.stop))
            else:
                lost[spec.name].append(rank)

    # (src, dst, name, state, lo, hi, spec, src shard start, dst shard start): sorted, then made
    # Transfers (sorting plain tuples is several times cheaper than sorting Transfers by key)
    rows: list[tuple[int, int, str, str, int, int, TensorSpec, int, int]] = []
    pieces: list[_Piece] = []
    missing: list[tuple[str, str, Index]] = []
    for dst in new.ranks():
        for spec, idx in tensors_of_rank(new, dst, specs):
            a, b = idx[_axis(spec)].start, idx[_axis(spec)].stop
            gaps = [(a, b)]
            mine = [(lo, hi) for r, lo, hi in holders[spec.name] if r == dst]
            if mine:
                lo, hi = max(a, mine[0][0]), min(b, mine[0][1])
                if lo < hi:
                    rows += [(dst, dst, spec.name, state, lo, hi, spec, mine[0][0], a) for state in states]
                    gaps = [(g0, g1) for g0, g1 in ((a, lo), (hi, b)) if g0 < g1]
            for g0, g1 in gaps:
                cuts = sorted({g0, g1} | {x for _, lo, hi in holders[spec.name] for x in (lo, hi) if g0 < x < g1})
                for lo, hi in zip(cuts, cuts[1:]):
                    cands = tuple(sorted(
                        (r, c0) for r, c0, c1 in holders[spec.name] if c0 <= lo and hi <= c1 and r != dst
                    ))
                    if not cands:
                        missing += [(spec.name, s, _global(spec, lo, hi)) for s in states]
                        continue
                    pieces += [_Piece(dst, spec, s, lo, hi, a, cands) for s in states]
    if missing:
        name, state, index = missing[0]
        where = ", ".join(f"{s.start}:{s.stop}" for s in index)
        raise ReshardError(
            f"reshard: no alive rank holds {state} of {name}[{where}] (its holders {sorted(set(lost[name]))} are dead"
            f" and no surviving data-parallel replica has it; {len(missing)} piece(s) missing in all); "
            "recover this state from the latest checkpoint",
            missing,
        )

    # LPT: largest pieces first, each to the least-loaded candidate of the best tier
    sent: dict[int, int] = defaultdict(int)
    chosen: list[tuple[_Piece, int, int]] = []
    order = sorted(
        pieces, key=lambda p: (-_nbytes(p.spec, p.lo, p.hi, sizes[p.state]), p.dst, p.spec.name, p.state, p.lo)
    )
    for p in order:
        nb = _nbytes(p.spec, p.lo, p.hi, sizes[p.state])
        dst_node = nodes.get(p.dst)

        def rank_key(c: tuple[int, int], dst_node: str | None = dst_node) -> tuple[int, int, int]:
            same = dst_node is not None and nodes.get(c[0]) == dst_node
            return (0 if same else 1, sent[c[0]], c[0])

        src, c0 = min(p.candidates, key=rank_key)
        sent[src] += nb
        chosen.append((p, src, c0))

    # merge adjacent pieces of one (dst, tensor, state) that come from the same source
    chosen.sort(key=lambda x: (x[0].dst, x[0].spec.name, x[0].state, x[0].lo))
    merged: list[list[Any]] = []
    for p, src, c0 in chosen:
        last = merged[-1] if merged else None
        if last and last[0].dst == p.dst and last[0].spec.name == p.spec.name and last[0].state == p.state \
                and last[1] == src and last[3] == p.lo:
            last[3] = p.hi
        else:
            merged.append([p, src, p.lo, p.hi, c0])
    rows += [(src, p.dst, p.spec.name, p.state, lo, hi, p.spec, c0, p.dst_start) for p, src, lo, hi, c0 in merged]

    # one order on every rank: (src, dst, tensor, state, interval); a tensor's shards differ
    # only on its split axis, so its interval orders them as their whole index would
    rows.sort(key=lambda r: r[:6])
    transfers = [
        Transfer(src, dst, name, state, _global(spec, lo, hi), _global(spec, lo, hi, c0), _global(spec, lo, hi, d0),
                 _nbytes(spec, lo, hi, sizes[state]))
        for src, dst, name, state, lo, hi, spec, c0, d0 in rows
    ]
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    moved = local = 0
    for t in transfers:
        if t.is_local:
            local += t.nbytes
        else:
            moved += t.nbytes
            send[t.src] += t.nbytes
            recv[t.dst] += t.nbytes
    return ReshardPlan(tuple(transfers), moved, local, dict(send), dict(recv))

