"""Process groups of one plan epoch: TP groups, pipeline peers, gradient-sync (DP) groups.

Everything is derived from the Plan value, so a new plan gives new groups:

- **TP**: the ranks of a (replica, stage).
- **PP**: point-to-point peers, each pair of neighbours on a two-rank group of its own. Stage
  s+1 rank j receives activations from stage s rank ``j mod tp_s``; stage s rank t receives
  gradients from stage s+1 rank ``t mod tp_{s+1}`` (activations and their gradients are
  replicated inside a TP group, so stages may even have different TP sizes). Not the default
  group: after a peer failure a rank lets go of its groups so that their connections close
  and a neighbour blocked in a receive from it fails at once (``sever``); the default group
  keeps references torch holds, and a receive on it waited out gloo's whole timeout.
- **DP**: a parameter shard ``(name, tp_index, tp_size)`` is held by one rank per replica;
  ranks holding the same shards sum their gradients. Shards are bucketed by their holder
  set, one group per distinct set — the usual "one DP group per (stage, TP rank)" when the
  replicas are alike, and still right when the replicas split layers differently. The
  replicas must agree on the TP size of every layer.
- **loss**: the last-stage ranks of all replicas (to sum the global loss).

Every rank of the world creates every group in one global order (sorted rank tuples; torch
names groups by a per-process counter, and one order also rules out deadlocks between
overlapping groups); only members connect. A rank set that occurs in several roles gets
one group.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from resihp.coordinator.model.plan import Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.runtime.layout import ModelLayout
from resihp.trainer_hooks.runtime.tp_layers import TPContext, bind_tp, pending_tp

LAYER_PARAMS = (
    "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
    "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
)
FIRST_PARAMS = ("embed.weight", "pos_embed.weight")
LAST_PARAMS = ("final_ln.weight", "final_ln.bias", "lm_head.weight")


@dataclass(frozen=True)
class StagePlace:
    """Where a rank sits and what it runs under a plan."""

    replica: int
    stage: int
    num_stages: int
    tp_index: int
    tp_size: int
    tp_ranks: tuple[int, ...]
    layer_range: tuple[int, int]
    microbatches: int
    recv_fwd_from: int | None
    send_fwd_to: tuple[int, ...]
    recv_bwd_from: int | None
    send_bwd_to: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def place_of(plan: Plan, rank: int) -> StagePlace:
    if plan.virtual_chunks != 1 or plan.schedule is not Schedule.ONE_F_ONE_B:
        raise SpecError(
            f"runtime: only the 1f1b schedule with one chunk per stage is implemented; the plan asks for "
            f"{plan.schedule.value} with {plan.virtual_chunks} chunk(s)"
        )
    pos = plan.position(rank)
    rep = plan.replicas[pos.replica]
    s, t = pos.stage, pos.tp_index
    here = rep.stages[s]
    prev = rep.stages[s - 1] if s > 0 else None
    nxt = rep.stages[s + 1] if s + 1 < rep.pp else None
    return StagePlace(
        replica=pos.replica, stage=s, num_stages=rep.pp, tp_index=t, tp_size=pos.tp_size, tp_ranks=here,
        layer_range=rep.layer_ranges()[s], microbatches=rep.microbatches,
        recv_fwd_from=prev[t % len(prev)] if prev else None,
        send_fwd_to=tuple(nxt[j] for j in range(len(nxt)) if j % len(here) == t) if nxt else (),
        recv_bwd_from=nxt[t % len(nxt)] if nxt else None,
        send_bwd_to=tuple(prev[j] for j in range(len(prev)) if j % len(here) == t) if prev else (),
    )


def pipeline_peers(place: StagePlace) -> tuple[int, ...]:
    """The ranks this place sends to or receives from, in either direction."""
    peers = {p for p in (place.recv_fwd_from, place.recv_bwd_from) if p is not None}
    return tuple(sorted(peers | set(place.send_fwd_to) | set(place.send_bwd_to)))


def param_names(place: StagePlace, layout: ModelLayout | None = None) -> list[str]:
    """The tensors this place holds: ``layout``'s (a user's model), by default the runtime GPT's."""
    if layout is not None:
        return layout.names(place.first, place.last, place.layer_range)
    names = list(FIRST_PARAMS) if place.first else []
    start, end = place.layer_range
    names += [f"layers.{i}.{leaf}" for i in range(start, end) for leaf in LAYER_PARAMS]
    if place.last:
        names += list(LAST_PARAMS)
    return names


def shard_holders(plan: Plan, layout: ModelLayout | None = None) -> dict[tuple[str, int, int], tuple[int, ...]]:
    """(param name, tp_index, tp_size) → the ranks whose gradients of that shard are summed:
    one per replica (a weight tied between the first and last stage: both ends of every
    replica). A parameter that holders split over different TP sizes (``mixed_tp_sizes``) is
    summed over every holder of the coarse shard its own shard lies in. Cached per layout
    (callers must not modify it): a switch asks for it several times, and
    ``LiveReconfigurer.prepare`` asks ahead, under another epoch."""
    return _shard_holders(plan.replicas, plan.schedule, plan.virtual_chunks, layout)[0]


def mixed_tp_sizes(plan: Plan, layout: ModelLayout | None = None) -> dict[str, int]:
    """The parameters that ``plan``'s holders split over different TP sizes (a replica that
    lost a device running a layer on TP4 where the others run TP8, or stages of one replica on
    different TP sizes holding a tied weight), each with the coarse TP size its gradient is
    summed over: the sizes' greatest common divisor, whose shards hold whole shards of every
    holder (TP8 and TP4: quarters, each summed over the two TP8 ranks and the one TP4 rank that
    hold parts of it; TP2 and TP1: the whole tensor). Their shards differ from holder to
    holder, so they are summed by coarse shard (``Runtime._sync_mixed``), not shard by shard.
    Cached (callers must not modify it)."""
    return _shard_holders(plan.replicas, plan.schedule, plan.virtual_chunks, layout)[1]


def mixed_tp_names(plan: Plan, layout: ModelLayout | None = None) -> frozenset[str]:
    """The names of ``mixed_tp_sizes``."""
    return frozenset(mixed_tp_sizes(plan, layout))


def coarse_shard(tp_index: int, tp_size: int, coarse: int) -> int:
    """Which of ``coarse`` even shards holds shard ``tp_index`` of ``tp_size`` (``coarse``
    divides ``tp_size``)."""
    return tp_index // (tp_size // coarse)


@functools.lru_cache(maxsize=16)
def _shard_holders(replicas: tuple[Any, ...], schedule: Schedule, virtual_chunks: int, layout: ModelLayout | None
                   ) -> tuple[dict[tuple[str, int, int], tuple[int, ...]], dict[str, int]]:
    plan = Plan(replicas, schedule, virtual_chunks)
    holders: dict[tuple[str, int, int], list[int]] = {}
    sizes: dict[str, set[int]] = {}
    for rank in plan.ranks():
        place = place_of(plan, rank)
        for name in param_names(place, layout):
            sizes.setdefault(name, set()).add(place.tp_size)
            holders.setdefault((name, place.tp_index, place.tp_size), []).append(rank)
    mixed = {name: math.gcd(*seen) for name, seen in sizes.items() if len(seen) > 1}
    by_coarse: dict[tuple[str, int], list[int]] = {}
    for (name, index, size), ranks in holders.items():
        if name in mixed:
            by_coarse.setdefault((name, coarse_shard(index, size, mixed[name])), []).extend(ranks)
    return ({(name, index, size): tuple(sorted(
        by_coarse[(name, coarse_shard(index, size, mixed[name]))] if name in mixed else ranks))
        for (name, index, size), ranks in holders.items()}, mixed)


@dataclass
class EpochGroups:
    """This rank's groups for one plan epoch."""

    epoch: int
    plan: Plan
    rank: int
    place: StagePlace
    tp: TPContext
    # holder rank set → (group or None for a set of one, the parameter names it syncs)
    grad_buckets: list[tuple[tuple[int, ...], Any, list[str]]] = field(default_factory=list)
    # the same for parameters split over different TP sizes (``mixed_tp_sizes``): by coarse shard
    mixed_buckets: list[tuple[tuple[int, ...], Any, list[str]]] = field(default_factory=list)
    loss_ranks: tuple[int, ...] = ()
    loss_group: Any = None
    # pipeline neighbour → its two-rank group; PipelineStep holds this very dict, so that
    # ``sever`` emptying it also takes the groups out of the pipeline
    peer_groups: dict[int, Any] = field(default_factory=dict)
    _by_ranks: dict[tuple[int, ...], Any] = field(default_factory=dict)

    def group_for(self, ranks: tuple[int, ...]) -> Any:
        return self._by_ranks.get(ranks)


def rank_sets(plan: Plan, layout: ModelLayout | None = None) -> frozenset[tuple[int, ...]]:
    """Every rank set that needs a group under ``plan`` (TP, DP holders, loss, pipeline
    neighbours); cached per layout."""
    return _rank_sets(plan.replicas, plan.schedule, plan.virtual_chunks, layout)


@functools.lru_cache(maxsize=16)
def _rank_sets(replicas: tuple[Any, ...], schedule: Schedule, virtual_chunks: int, layout: ModelLayout | None
               ) -> frozenset[tuple[int, ...]]:
    plan = Plan(replicas, schedule, virtual_chunks)
    sets: set[tuple[int, ...]] = {tuple(sorted(g)) for rep in plan.replicas for g in rep.stages}
    sets |= set(shard_holders(plan, layout).values())
    sets.add(tuple(sorted(r for rep in plan.replicas for r in rep.stages[-1])))
    for rank in plan.ranks():
        sets |= {tuple(sorted((rank, peer))) for peer in pipeline_peers(place_of(plan, rank))}
    return frozenset(sets)


def make_groups(plans: Sequence[Plan], rank: int, layout: ModelLayout | None = None,
                existing: frozenset[tuple[int, ...]] = frozenset()) -> dict[tuple[int, ...], Any]:
    """Create the groups of ``plans``; EVERY rank of the world calls this with the same plans.

    torch names a group after a per-process counter, so all ranks must create all groups in
    one order (sorted rank tuples) even where they are not members (that part is local and
    cheap: only members connect). Several plans may share a world (disjoint sub-jobs).
    ``existing``: rank sets whose groups are kept from before (the same on every rank); they
    are not made again and not returned.
    """
    wanted: set[tuple[int, ...]] = set()
    for plan in plans:
        wanted |= rank_sets(plan, layout)
    made: dict[tuple[int, ...], Any] = {}
    for ranks in sorted(wanted):
        if len(ranks) < 2 or ranks in existing:
            continue
        # a set spanning the whole world gets a group of its own too, not the default group:
        # a rank that leaves a failed step closes its groups' connections to wake the peers
        # blocked on it (``sever``), and the default group's never close (torch holds it)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            made[ranks] = group
    return made


def build_groups(
    plan: Plan, rank: int, epoch: int, spec: ModelSpec | None = None, cohabitants: Sequence[Plan] = (),
    made: dict[tuple[int, ...], Any] | None = None, layout: ModelLayout | None = None,
) -> EpochGroups:
    """This rank's groups under ``plan``. Collective over the whole world: every rank calls it
    (with the same ``cohabitants``: other plans running on disjoint ranks of the same world).
    ``made``: what ``make_groups([plan, *cohabitants], rank)`` returned, if it ran already
    (then this call is local). ``layout``: the model's tensors (None: the runtime's GPT)."""
    if spec is not None:
        plan.validate_for(spec.num_layers, spec.num_heads)
    place = place_of(plan, rank)
    holders = shard_holders(plan, layout)
    if made is None:
        made = make_groups([plan, *cohabitants], rank, layout)
    loss_ranks = tuple(sorted(r for rep in plan.replicas for r in rep.stages[-1]))
    tp = TPContext(group=made.get(tuple(sorted(place.tp_ranks))), index=place.tp_index, size=place.tp_size)
    mixed = mixed_tp_sizes(plan, layout)
    buckets: dict[tuple[bool, tuple[int, ...]], list[str]] = {}
    for name in param_names(place, layout):
        buckets.setdefault((name in mixed, holders[(name, place.tp_index, place.tp_size)]), []).append(name)
    return EpochGroups(
        epoch=epoch, plan=plan, rank=rank, place=place, tp=tp,
        grad_buckets=[(ranks, made.get(ranks), names) for (whole, ranks), names in sorted(buckets.items()) if not whole],
        mixed_buckets=[(ranks, made.get(ranks), names) for (whole, ranks), names in sorted(buckets.items()) if whole],
        loss_ranks=loss_ranks, loss_group=made.get(loss_ranks) if rank in loss_ranks else None,
        peer_groups={peer: made[tuple(sorted((rank, peer)))] for peer in pipeline_peers(place)},
        _by_ranks=made,
    )


def destroy_groups(groups: EpochGroups, keep: frozenset[tuple[int, ...]] = frozenset()) -> None:
    """Destroy this epoch's groups, except those of the rank sets in ``keep`` (the next plan's too)."""
    for ranks, group in groups._by_ranks.items():
        if group is not None and ranks not in keep:
            dist.destroy_process_group(group)
    groups._by_ranks.clear()  # peer_groups stay: whoever lets go of the groups (sever, retire) drops them


def communicators(groups: EpochGroups) -> list[Any]:
    """Every process group ``groups`` holds (a group may appear more than once)."""
    held = [g for g in groups._by_ranks.values() if g is not None]
    held += [g for _, g, _ in groups.grad_buckets + groups.mixed_buckets if g is not None]
    held += [g for g in (groups.loss_group, groups.tp.group) if g is not None]
    return held + list(groups.peer_groups.values())


def sever(groups: EpochGroups, model: Any = None) -> list[Any]:
    """Take every process group out of ``groups`` (and ``model``'s TP layers) and return them.

    After a peer failure this rank's groups are dead, but while anything still references
    them their connections stay open, and a peer blocked in a collective with this rank waits
    out its whole timeout. Once the caller lets go of the returned list (``retire``), the
    groups' destructors close the connections: such a peer fails at once and recovers too,
    and so on down the job."""
    held = communicators(groups)
    groups._by_ranks.clear()
    groups.peer_groups.clear()
    groups.grad_buckets = [(ranks, None, names) for ranks, _, names in groups.grad_buckets]
    groups.mixed_buckets = [(ranks, None, names) for ranks, _, names in groups.mixed_buckets]
    groups.loss_group = None
    groups.tp = pending_tp(groups.tp.index, groups.tp.size)
    if model is not None:
        bind_tp(model, groups.tp)
    return held


_graveyard: queue.SimpleQueue[Any] | None = None
_graveyard_lock = threading.Lock()
_graves_open = 0  # objects handed to retire() whose destructors have not finished yet
_graves_done = threading.Condition(_graveyard_lock)


def retire(obj: Any) -> None:
    """Let go of ``obj`` (an old runtime and the process groups it holds) on a background thread.

    Dropping the last reference to a gloo group runs its destructor, which closes the group's
    connections and waits for its peers to do the same (15–25 ms per switch measured on this
    machine) without holding the GIL. Nothing of the new epoch needs that wait: it leaves
    the switch's critical path. The caller must hold no other reference it expects to free.
    """
    global _graveyard, _graves_open
    if obj is None:
        return
    with _graveyard_lock:
        if _graveyard is None:
            _graveyard = queue.SimpleQueue()
            threading.Thread(target=_bury, args=(_graveyard,), name="resihp-retire", daemon=True).start()
        _graves_open += 1
    _graveyard.put(obj)


def retire_each(objs: list[Any]) -> None:
    """Let go of every object of ``objs`` at once, each on a thread of its own, and empty the
    list. After a peer failure (``failstop.abandon_groups``) each gloo group's destructor closes
    its connections and then waits for its peers; one after another on the retire thread, a
    rank's second group stayed open while the first waited, and the peers blocked on the
    second learnt of the failure one such wait later. Together, every peer blocked on this
    rank wakes at once."""
    global _graves_open
    while objs:
        box = [objs.pop()]
        with _graveyard_lock:
            _graves_open += 1
        threading.Thread(target=_bury_box, args=(box,), name="resihp-retire-each", daemon=True).start()
        del box


def _bury_box(box: list[Any]) -> None:
    global _graves_open
    box.clear()  # the destructor runs here, on this thread
    with _graves_done:
        _graves_open -= 1
        _graves_done.notify_all()


def wait_retired(timeout_s: float) -> bool:
    """Wait until everything handed to ``retire`` so far has been let go of; False on timeout.
    For measurements that must not overlap the teardown of earlier groups."""
    with _graves_done:
        return _graves_done.wait_for(lambda: _graves_open == 0, timeout_s)


def _bury(graves: queue.SimpleQueue[Any]) -> None:
    global _graves_open
    while True:
        obj = graves.get()
        del obj  # the destructors run here, on this thread
        with _graves_done:
            _graves_open -= 1
            _graves_done.notify_all()
