"""The world a switch runs in: the job's store, the default group, the members' arrival at
a switch, and the groups a planned switch keeps.

Plans speak *logical* ranks; groups speak the ranks of the current world (``renumber``).
A recovery builds a new world (``init_world``: a new default group under the store prefix
``resihp/epoch{N}/``, so no key of an older epoch is read again). A planned switch among
the same members keeps the default group and every group whose rank set both plans need
(``kept_groups``), once every rank agrees it can: creating a group waits on every member
(store round trips, connections; an NCCL communicator's init takes seconds at scale). What the
ranks must agree on before they move state (whether to keep the groups, whether every holder
has optimizer moments, the optimizer's step count) travels with their arrival in the store
(``await_arrivals``'s ``word``), not in a collective: a peer that dies inside a gloo
collective on the default group leaves the others waiting out its timeout (the chaos run's
kill inside a switch: 6 s), a store wait stops at the coordinator's death notice. Used by
``reconfig.live``.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.launch.backends import world_backend
from resihp.trainer_hooks.reporting.deaths import DEATHS, DeathNotices, PeerDeclaredDead
from resihp.trainer_hooks.runtime.groups import EpochGroups, rank_sets, retire
from resihp.trainer_hooks.runtime.layout import ModelLayout

# the logical ranks whose processes MPI knows failed (``ulfm.failed_processes`` of the world)
FailedProcesses = Callable[[], frozenset[int]]
ARRIVAL_SLICE_S = 0.1  # a switch's wait for its members reads the death notices this often
WORD_END = ";"  # ends each member's word in the switch's one key of words
RankSet = tuple[int, ...]


def renumber(plan: Plan, mapping: Mapping[int, int]) -> Plan:
    """``plan`` with every rank ``r`` replaced by ``mapping[r]`` (logical ↔ group ranks)."""
    missing = sorted(r for r in (*plan.ranks(), *plan.spares) if r not in mapping)
    if missing:
        raise SpecError(f"reconfigure: ranks {missing} of the plan are not in the current world {sorted(mapping)}")
    reps = tuple(
        replace(rep, stages=tuple(tuple(mapping[r] for r in g) for g in rep.stages))  # shares (tokens too) kept
        for rep in plan.replicas
    )
    return replace(plan, replicas=reps, spares=tuple(mapping[r] for r in plan.spares))


@contextlib.contextmanager
def group_timeout(timeout_s: float | None) -> Iterator[None]:
    """Sub-groups made inside get ``timeout_s`` (torch's ``new_group`` default for gloo is 30 min,
    far too long to notice a dead peer; groups.make_groups has no timeout argument yet)."""
    if timeout_s is None:
        yield
        return
    saved = c10d.default_pg_timeout
    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    try:
        yield
    finally:
        c10d.default_pg_timeout = saved


def connect_store(store_addr: str, timeout_s: float) -> Any:
    """A client of the job's store (hosted outside the trainers, launch/store_server.py) at
    ``host:port``, authenticated with the ranks' credential (``$RESIHP_RANK_TOKEN``)."""
    from resihp.trainer_hooks.launch.store_client import connect

    host, _, port = store_addr.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError(f"reconfigure: store address {store_addr!r} is not host:port")
    if "GLOO_SOCKET_IFNAME" not in os.environ and host in ("127.0.0.1", "localhost"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    return connect(store_addr, timedelta(seconds=max(timeout_s, 30.0)))


def init_world(store: str | Any, epoch: int, rank: int, size: int, timeout_s: float, backend: str = "gloo") -> None:
    """(Re)create the default process group of ``size`` ranks under ``resihp/epoch{epoch}/``.

    ``store``: a client of the job's store, or its ``host:port`` (then a new client is made).
    ``backend``: the job's (gloo | nccl); under NCCL the group also carries gloo for the
    switch's CPU buffers (launch/backends.py)."""
    if dist.is_initialized():
        # the old group's destructor waits ~20 ms for its threads and peers: hold the last
        # reference past destroy_process_group and let it go on the retire thread
        old = c10d._get_default_group()
        dist.destroy_process_group()
        retire(old)
        del old
    if isinstance(store, str):
        store = connect_store(store, timeout_s)
    dist.init_process_group(
        world_backend(backend), store=dist.PrefixStore(f"resihp/epoch{epoch}/", store),  # type: ignore[attr-defined]
        rank=rank, world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )


def await_arrivals(store: Any, epoch: int, rank: int, members: Sequence[int], timeout_s: float,
                   deaths: DeathNotices = DEATHS, word: str = "1", failed: FailedProcesses | None = None) -> list[str]:
    """Every member of epoch ``epoch`` has reached its switch, before any rank enters gloo's
    rendezvous (which can only wait out its timeout for a dead peer). Waiting here, a rank
    stops at once when the coordinator announces one of the members dead (``deaths``, heard
    on the hook's command thread): ``PeerDeclaredDead``, a peer failure the caller recovers
    from. A member that never arrives, unannounced, is a "wait timeout" as gloo's would be.
    Returns every member's ``word`` (what this rank brings to the switch), in the order the
    members arrived: the same words on every rank, for agreements that do not depend on order
    (all, max). They are appended to one key, read with one ``get`` at the end: 0.05 ms for
    1,024 words here, where a ``multi_get`` of 1,024 arrival keys took 1.4 ms of the store's
    time per rank, one rank after another."""
    if WORD_END in word:
        raise SpecError(f"reconfigure: an arrival word may not hold {WORD_END!r}: {word!r}")
    prefix = f"resihp/arrive{epoch}/"
    store.append(f"{prefix}words", word + WORD_END)  # before the arrival: every arrived member's word is in
    store.set(f"{prefix}{rank}", "1")
    keys = [f"{prefix}{r}" for r in members]
    deadline = time.monotonic() + timeout_s
    while True:
        why = death_text(members, epoch, deaths, failed)
        if why:
            raise PeerDeclaredDead(f"rank {rank}: {why} while epoch {epoch}'s switch waited for them")
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [r for r in members if not store.check([f"{prefix}{r}"])]
            raise RuntimeError(f"rank {rank}: wait timeout after {timeout_s:g} s: ranks {missing} did not reach "
                               f"epoch {epoch}'s switch")
        # the store answers as soon as the last member arrives (a poll with back-off answered
        # up to its 20 ms pause late, on the switch's critical path); between slices the
        # coordinator's death notices are read
        try:  # never a slice under 1 ms: c10d reads a timeout of 0 ms as "wait for ever"
            store.wait(keys, timedelta(seconds=max(0.002, min(ARRIVAL_SLICE_S, left))))
        except dist.DistStoreError:
            continue
        return [w for w in bytes(store.get(f"{prefix}words")).decode().split(WORD_END) if w]


def dead_text(dead: Sequence[int], epoch: int) -> str:
    return f"the coordinator declared ranks {list(dead)} of epoch {epoch} dead" if dead else ""


def death_text(members: Sequence[int], epoch: int, deaths: DeathNotices = DEATHS,
               failed: FailedProcesses | None = None) -> str:
    """Why a wait for ``members`` of epoch ``epoch`` should stop ("" while it should not): the
    coordinator's death notice of one of them, or else MPI's own word (``failed``: the
    logical ranks whose processes MPI knows failed, ``ulfm.failed_processes``), which is all
    a job run without a coordinator has."""
    why = dead_text(deaths.dead_among(members, epoch - 1), epoch)
    if why or failed is None:
        return why
    gone = sorted(set(members) & failed())
    return f"MPI reports the processes of ranks {gone} of epoch {epoch} failed" if gone else ""


def kept_groups(old: Plan, new: Plan, numbering: Mapping[int, int], layout: ModelLayout | None,
                held: EpochGroups | None) -> tuple[frozenset[RankSet], dict[RankSet, Any]] | None:
    """For a planned switch among the same members (``numbering``: logical → group rank): the
    rank sets, in group ranks, whose groups ``old`` made and ``new`` needs again — the same on
    every rank, a function of the two plans — and this rank's handles of those it is in
    (from ``held``, its runtime's groups). None where it no longer holds one of them, or the
    plans' groups cannot be listed; the default group's set and sets of one rank are left out."""
    try:
        both = rank_sets(renumber(old, numbering), layout) & rank_sets(renumber(new, numbering), layout)
    except SpecError:
        return None
    world = len(numbering)
    both = frozenset(r for r in both if 1 < len(r) < world)
    # a spare holds no groups and is in none of ``old``'s sets
    mine = {r: held.group_for(r) for r in both if held.rank in r} if held is not None else {}
    if any(g is None for g in mine.values()):
        return None
    return both, mine


def arrival_word(can_keep: bool, has_moments: bool, step_count: float, next_step: int = -1) -> str:
    """What a rank brings to a switch (``await_arrivals``'s word): whether it can keep the
    groups, whether it has the optimizer's moments (or holds no old state), the optimizer's
    step count (``repr`` keeps the float exact) and the training step it goes on from (-1:
    none of its own, an idle spare)."""
    return f"{int(can_keep)} {int(has_moments)} {float(step_count)!r} {int(next_step)}"


def parse_arrival_word(word: str) -> tuple[bool, bool, float, int]:
    try:
        keep, moments, steps, step = word.split()
        return keep == "1", moments == "1", float(steps), int(step)
    except ValueError:
        raise SpecError(f"reconfigure: a member's arrival at the switch reads {word!r}, not 'KEEP MOMENTS STEPS "
                        f"NEXT': are two versions of resihp in one job?") from None


class SwitchAgreement(NamedTuple):
    """What the members' words agree on: every rank keeps the groups or none does; the
    optimizer's moments move only if every old holder has them; the largest step count and
    training step win (a readmitted spare learns them)."""

    keep_groups: bool
    moments: bool
    optimizer_steps: float
    next_step: int


def agree(words: Iterable[str]) -> SwitchAgreement:
    """The agreement of ``await_arrivals``'s words (order-free: the same on every rank)."""
    keep, moments, steps, step = zip(*(parse_arrival_word(w) for w in words))
    return SwitchAgreement(all(keep), all(moments), max(steps), max(step))
