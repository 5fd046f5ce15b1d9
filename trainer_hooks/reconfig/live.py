"""Live reconfiguration: switch a running job to a new Plan at a step boundary.

All ranks of the world call ``LiveReconfigurer.apply(new_plan, epoch)`` at the same
iteration boundary (the hooks do so when a ``ReconfigCommand`` reaches its ``apply_at``).
One switch is:

1. **regroup** — the default torch.distributed group is rebuilt for the new epoch under a
   fresh store prefix ``resihp/epoch{N}/`` (no key of an older epoch is read again). A
   planned switch among the same members instead keeps the default group and every group
   whose rank set the new plan needs again (all ranks agree on it with one all-reduce):
   only the groups of new rank sets are made;
2. **reshard** — ``plan_reshard`` + ``start_reshard`` move parameters and AdamW's
   ``exp_avg`` / ``exp_avg_sq`` to their owners under the new plan on that group; while
   the pieces are on the wire the new plan's TP/DP/loss groups are created (that waits on
   peers, not on the CPU); the step count is a scalar every member held, agreed with one
   all-reduce (MAX), so a readmitted spare gets it too;
3. **rebuild** — a new ``Runtime`` (stage module built ahead, AdamW) is bound to those
   groups and loaded with the received shards; the data stream is carried over.

A rank that the new plan leaves out (``plan.spares``, or simply absent) stays in the world
as a spare: it holds no state, still joins every group creation (torch numbers groups by a
per-process counter, so every rank must create every group) and can be readmitted by a
later plan through the same path.

Plans speak *logical* ranks (job-wide identities). ``members`` lists the logical ranks of
the current world in process-group order; after a fail-stop shrink (reconfig.failstop) the
world is smaller and a logical rank's group rank changes. The runtime itself is built on
the plan renumbered into group ranks (``renumber``).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.launch.backends import group_carries_cpu
from resihp.trainer_hooks.reconfig.rank_view import prepare_rank
from resihp.trainer_hooks.reconfig.reshard import ReshardPlan, plan_reshard
from resihp.trainer_hooks.reconfig.transfer import Shards, start_reshard
from resihp.trainer_hooks.reconfig.world import (
    FailedProcesses,
    agree,
    arrival_word,
    await_arrivals,
    connect_store,
    death_text,
    group_timeout,
    init_world,
    kept_groups,
    renumber,
)
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.runtime.gc_control import paused
from resihp.trainer_hooks.runtime.groups import StagePlace, destroy_groups, make_groups, place_of, rank_sets, retire
from resihp.trainer_hooks.runtime.layout import TensorSpec, gpt_tensor_specs
from resihp.trainer_hooks.runtime.optim import OptimizerFactory, holds_all, state_names, states_of
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.trainer import Runtime, StageAhead, StepResult, TrainConfig, build_stage_ahead

if TYPE_CHECKING:
    from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe

log = logging.getLogger(__name__)


def _stage_key(place: StagePlace) -> tuple[Any, ...]:
    """What a stage module's structure depends on."""
    return (place.layer_range, place.first, place.last, place.tp_index, place.tp_size)


def runtime_shards(rt: Runtime, *, clone: bool = False) -> Shards:
    """state → layout name → this rank's shard (parameters and the optimizer's per-parameter
    tensors: AdamW's moments, SGD's momentum, ...; none before its first step)."""
    params = rt.shards()
    out: Shards = {"param": {n: (p.clone() if clone else p) for n, p in params.items()}}
    opt = rt.optimizer_state()
    names = rt.opt_states.tensors
    if all(holds_all(opt[n], names) for n in params):
        for s in names:
            out[s] = {n: (opt[n][s].clone() if clone else opt[n][s]) for n in params}
    return out


def optimizer_steps(rt: Runtime | None) -> float:
    """AdamW's step count on this rank (0 before the first step, or on a spare)."""
    if rt is None:
        return 0.0
    for st in rt.optimizer_state().values():
        if "step" in st:
            return float(st["step"])
    return 0.0


@torch.no_grad()
def load_shards(rt: Runtime, shards: Shards, step: float) -> None:
    """Put received shards into ``rt``'s parameters and optimizer state (``step`` = its count)."""
    kinds = rt.opt_states
    moments = holds_all(shards, kinds.tensors)
    state = rt.optimizer.state
    for name, p in rt.parameters().items():
        got = shards["param"][name]
        if got.shape == p.shape and got.dtype == p.dtype and got.device == p.device and got.is_contiguous():
            p.data = got  # the received (or kept) tensor becomes the parameter: no copy
        else:
            p.copy_(got)
        if moments:
            # the received shards are fresh tensors this rank owns; AdamW keeps the step as a
            # float32 scalar tensor (capturable=False on CPU), one per parameter (it adds to each)
            entry: dict[str, Any] = {s: (t if t.device == p.device else t.to(p.device))
                                     for s in kinds.tensors for t in (shards[s][name],)}
            if kinds.has_step:
                entry["step"] = kinds.step_value(step)
            state[p] = entry


@dataclass
class ReconfigReport:
    """What one switch did on this rank (times in seconds, on this rank's clock)."""

    epoch: int
    role: str  # "member" | "spare"
    regroup_s: float = 0.0  # arrival of every member (with what the ranks agree on), then the new default group (if made)
    reshard_s: float = 0.0  # transfers (the new plan's sub-groups are made while they fly)
    rebuild_s: float = 0.0  # new Runtime on those groups + load
    bytes_moved: int = 0  # job-wide, over the network
    bytes_local: int = 0
    downtime_s: float = 0.0  # apply() entered -> this rank holds its new state and groups
    # a planned switch in an unchanged world keeps the default group and every group whose
    # rank set the new plan needs again: how many of this rank's groups it kept
    groups_kept: int = 0
    world_kept: bool = False
    # the largest training step the members said they go on from (``apply``'s ``next_step``;
    # -1 if none said): a readmitted spare learns the job's step from it, with no collective
    next_step: int = -1
    reshard: ReshardPlan | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "reshard"}


class LiveReconfigurer:
    """One rank's runtime that can switch plans live. Every rank of the world holds one.

    ``rank``: this process's logical rank; ``members``: logical ranks of the world in group
    order (default: ``range(world)``, identity numbering); ``store_addr``: ``host:port`` of
    the job's store (``Bootstrap.info().store_addr``). The default group of the current
    world must exist (``Bootstrap.init_epoch`` or ``init_world``). Given ``runtime`` (e.g.
    ``job.runtime``) it is adopted; otherwise the runtime, or a spare's share of the group
    creation, is built here — collectively, so every rank constructs its reconfigurer at the
    same point. ``epoch``: the current plan epoch (default ``plan.epoch``).
    ``timeout_s``: of the default group (and the reshard's messages); ``group_timeout_s``:
    of the TP/DP/loss sub-groups (None: torch's default, 30 min for gloo) — keep both short
    where a rank may die.
    """

    def __init__(
        self, spec: ModelSpec, plan: Plan, rank: int, config: TrainConfig, store_addr: str, *,
        members: Sequence[int] | None = None, runtime: Runtime | None = None, throttle: Throttle | None = None,
        timeout_s: float = 60.0, group_timeout_s: float | None = None, backend: str = "gloo",
        epoch: int | None = None, recipe: UserModelRecipe | None = None, optimizer: OptimizerFactory | None = None,
    ) -> None:
        self.spec = spec
        self.recipe = recipe  # a user's model (trainer_hooks/usermodel); None: the runtime's GPT
        self.layout = recipe.layout() if recipe is not None else None
        self.optimizer = optimizer  # None: AdamW from the config
        self.opt_states = states_of(optimizer)  # a spare, which holds no runtime, must know them too
        self.config = config
        self.rank = rank
        self.store_addr = store_addr
        self.members: tuple[int, ...] = tuple(members if members is not None else range(dist.get_world_size()))
        self.timeout_s = timeout_s
        self.group_timeout_s = group_timeout_s
        self.backend = backend
        self.throttle = throttle or Throttle()
        self.specs: list[TensorSpec] = (self.layout.tensor_specs() if self.layout is not None
                                        else gpt_tensor_specs(spec, config.max_seq_len))
        self.plan = plan
        self.epoch = plan.epoch if epoch is None else epoch
        self.history: list[ReconfigReport] = []
        self._prepared: dict[Any, ReshardPlan] = {}
        self._prepare_lock = threading.Lock()
        self._store: Any = None  # client of the job's store, kept across epochs
        self._stage: tuple[tuple[Any, ...], StageAhead] | None = None  # the next plan's module, built ahead
        # a planned switch among the same members keeps the world and the groups both plans need
        # (False: every switch builds them anew, as a recovery must)
        self.keep_groups = True
        # MPI's word on failed processes (``ulfm.failed_processes`` of the current MPI world;
        # set by the resilient loop): a switch's store waits end on it as on the coordinator's
        # death notices, which a job run without a coordinator never gets
        self.failed_processes: FailedProcesses | None = None
        self.runtime: Runtime | None = runtime
        self._data: Any = runtime.data if runtime is not None else None
        if runtime is None:
            self._build(plan)

    # --- numbering --------------------------------------------------------------------
    def pg_rank_of(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.members)}

    @property
    def pg_rank(self) -> int:
        return self.pg_rank_of()[self.rank]

    @property
    def is_member(self) -> bool:
        return self.plan.has_rank(self.rank)

    # --- training -----------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult | None:
        """One iteration of this rank's share (None on a spare, which has nothing to do)."""
        return self.runtime.train_step(step) if self.runtime is not None else None

    # --- switching ----------------------------------------------------------------------
    def _make_groups(self, plan: Plan, existing: frozenset[tuple[int, ...]] = frozenset()) -> dict[tuple[int, ...], Any]:
        """The process groups of ``plan`` (collective: every rank of the world creates every group),
        less those of the rank sets in ``existing`` (kept from the current plan)."""
        with group_timeout(self.group_timeout_s):
            return make_groups([renumber(plan, self.pg_rank_of())], self.pg_rank, self.layout, existing)

    def _build(self, plan: Plan, *, init_weights: bool = True, made: dict[tuple[int, ...], Any] | None = None) -> None:
        """Runtime (member) or bare group creation (spare) for ``plan``; collective unless
        ``made`` holds the plan's groups (``_make_groups``) already."""
        local = renumber(plan, self.pg_rank_of())
        with group_timeout(self.group_timeout_s):
            if plan.has_rank(self.rank):
                place = place_of(local, self.pg_rank)
                stage, self._stage = self._stage, None
                if stage is not None and stage[0] != _stage_key(place):
                    stage = None
                old, self.runtime = self.runtime, None
                retire(old)  # its groups' teardown waits for peers: not on the switch's path
                del old
                rt = Runtime(self.spec, local, self.pg_rank, self.config, throttle=self.throttle, epoch=plan.epoch,
                             data=self._data,  # the packed stream goes on: same samples, no re-packing
                             model=stage[1] if stage is not None else None, init_weights=init_weights,
                             made_groups=made, recipe=self.recipe, optimizer=self.optimizer)
                self._data = rt.data
                self.runtime = rt
            else:
                old, self.runtime = self.runtime, None
                retire(old)
                del old
                if made is None:
                    self._make_groups(plan)

    def _build_stage_ahead(self, new_plan: Plan) -> None:
        """Build this rank's stage module of ``new_plan`` now (undrawn weights, TP group pending,
        with its parameter table and an empty AdamW), so the switch only binds groups and loads
        state. Worth it where the command comes ahead of its ``apply_at``; empty parameters cost no memory until written, and the
        received shards replace them without a copy."""
        if not new_plan.has_rank(self.rank):
            self._stage = None
            return
        place = place_of(new_plan, self.rank)  # the structure does not depend on the numbering
        if self._stage is None or self._stage[0] != _stage_key(place):
            device = self.runtime.device if self.runtime is not None else None
            self._stage = (_stage_key(place), build_stage_ahead(self.spec, self.config, place, device=device,
                                                                           recipe=self.recipe,
                                                                           optimizer=self.optimizer))

    def prepare(self, new_plan: Plan, alive: Sequence[int] | None = None,
                states: Sequence[str] | None = None, *, stock: bool = True) -> ReshardPlan:
        """The reshard plan from the current plan to ``new_plan`` (pure, deterministic; cached).

        A command arrives before its ``apply_at``: calling this on receipt takes the planning
        (tens of ms of Python) and the construction of this rank's new stage module out of
        the downtime. ``apply`` reuses what was prepared. ``stock``: also allocate this rank's
        message buffers and new shards now (paging in fresh memory cost the switch more than
        copying into it); they are held until the switch."""
        with self._prepare_lock:  # the main thread and a fail-stop's prepare-ahead thread
            return self._prepare(new_plan, alive, states, stock)

    def _prepare(self, new_plan: Plan, alive: Sequence[int] | None, states: Sequence[str] | None,
                 stock: bool) -> ReshardPlan:
        who = tuple(sorted(alive if alive is not None else self.members))  # a set: the reshard plan's view
        states = state_names(self.opt_states) if states is None else states
        self._build_stage_ahead(new_plan)
        key = (self.plan, replace(new_plan, epoch=0, reason=""), who, tuple(states))
        cached = self._prepared.get(key)
        if cached is None:
            cached = plan_reshard(self.plan, new_plan, self.specs, who, states=states)
            self._prepared = {key: cached}  # only the next switch is worth keeping
            with contextlib.suppress(SpecError):  # the groups' rank sets (cached), in group numbering
                rank_sets(renumber(new_plan, self.pg_rank_of()), self.layout)
        # this rank's part of it; for a planned switch (no ``alive``: it reshards from the live
        # runtime) its pieces are cut ahead out of the runtime's tensors
        live = runtime_shards(self.runtime) if stock and alive is None and self.runtime is not None else None
        prepare_rank(cached, self.rank, new_plan, self.specs, stock=stock, old_shards=live)
        return cached

    def store(self) -> Any:
        """This rank's client of the job's store (made on first use, kept across epochs)."""
        if self._store is None:
            self._store = connect_store(self.store_addr, self.timeout_s)
        return self._store

    def _release(self, keep: frozenset[tuple[int, ...]] = frozenset()) -> None:
        if self.runtime is not None:
            destroy_groups(self.runtime.groups, keep)

    def apply(self, new_plan: Plan, epoch: int | None = None, *, old_shards: Shards | None = None,
              alive: Sequence[int] | None = None, members: Sequence[int] | None = None,
              adam_steps: float | None = None, stats: dict[str, float] | None = None,
              next_step: int = -1) -> ReconfigReport:
        """Switch every rank of the world to ``new_plan`` (collective; call at a step boundary).

        ``epoch``: the new plan epoch (default ``new_plan.epoch``; must exceed the current one).
        ``old_shards`` / ``alive`` / ``members`` are for fail-stop recovery (reconfig.failstop):
        the state to reshard from (a rolled-back copy) with its AdamW step count
        (``adam_steps``), the ranks that can send, and the new world's logical ranks; by
        default the live runtime's state, the whole world. ``stats``: filled by the executor.
        ``next_step``: the training step this rank goes on from (-1: none of its own); the
        report's ``next_step`` is the largest any member said.
        No automatic garbage collection runs inside the switch (runtime/gc_control.py).
        """
        target = new_plan.epoch if epoch is None else epoch
        joining = tuple(members) if members is not None else self.members
        store = self.store()
        # gloo's rendezvous waits in the store for every member of the new world: a member the
        # coordinator declares dead meanwhile (killed inside the switch, after its arrival)
        # ends the wait now, a peer failure the caller recovers from, not at the timeout
        interruptible = hasattr(store, "interrupt")  # our AuthStore; a plain TCPStore (tests) is not
        if interruptible:
            store.interrupt = lambda: death_text(joining, target, DEATHS, self.failed_processes)
        try:
            with paused():
                return self._apply(new_plan, epoch, old_shards=old_shards, alive=alive, members=members,
                                   adam_steps=adam_steps, stats=stats, next_step=next_step)
        finally:
            if interruptible:
                store.interrupt = None

    def _apply(self, new_plan: Plan, epoch: int | None, *, old_shards: Shards | None,
               alive: Sequence[int] | None, members: Sequence[int] | None,
               adam_steps: float | None, stats: dict[str, float] | None, next_step: int) -> ReconfigReport:
        epoch = new_plan.epoch if epoch is None else epoch
        if epoch <= self.epoch:
            raise SpecError(f"reconfigure: epoch {epoch} is not newer than the current epoch {self.epoch}")
        new_members = tuple(members) if members is not None else self.members
        new_plan.validate_for(self.spec.num_layers, self.spec.num_heads)
        outside = sorted(set(new_plan.ranks()) - set(new_members))
        if outside:
            raise SpecError(f"reconfigure: the new plan gives work to ranks {outside}, which are not in the world "
                            f"{list(new_members)}")
        new_plan = replace(new_plan, epoch=epoch)
        t0 = time.perf_counter()
        shards = old_shards if old_shards is not None else (
            runtime_shards(self.runtime) if self.runtime is not None else {})
        step_count = optimizer_steps(self.runtime) if adam_steps is None else adam_steps
        # a planned switch among the same members may keep the world and the groups both plans
        # need (world.kept_groups); whether to try is alike on every rank, whether it can is agreed
        # (a script's own NCCL-only world cannot carry the switch's CPU buffers: it is replaced)
        may_keep = (self.keep_groups and members is None and alive is None and old_shards is None
                    and group_carries_cpu() and dist.get_world_size() == len(self.members))
        mine = kept_groups(self.plan, new_plan, self.pg_rank_of(), self.layout,
                           self.runtime.groups if self.runtime is not None else None) if may_keep else None
        # what every rank must know before state moves comes with the arrivals, not in a gloo
        # collective (world.py): whether it can keep the groups; whether, as an old holder, it
        # has the optimizer's moments (not before the first step); the optimizer's step count
        # and the training step (the largest of each, so a readmitted spare learns them too)
        holder = self.plan.has_rank(self.rank) and (alive is None or self.rank in alive)
        moments = holds_all(shards, self.opt_states.tensors)
        agreed = agree(await_arrivals(self.store(), epoch, self.rank, new_members, self.timeout_s,
                                      failed=self.failed_processes, word=arrival_word(mine is not None, not holder or moments, step_count, next_step)))
        keep = may_keep and agreed.keep_groups
        kept_sets, kept = mine if keep and mine is not None else (frozenset(), {})
        self._release(kept_sets)
        # 1. regroup: fresh default group under the new epoch's prefix (unless the world is kept)
        self.members = new_members
        if not keep:
            init_world(self.store(), epoch, self.pg_rank, len(self.members), self.timeout_s, self.backend)
        else:  # the groups this switch makes get today's timeouts; so do the kept ones
            c10d._set_pg_timeout(timedelta(seconds=self.timeout_s))
            if self.group_timeout_s is not None:  # None: torch's default, which they have
                for group in kept.values():
                    c10d._set_pg_timeout(timedelta(seconds=self.group_timeout_s), group)
        t1 = time.perf_counter()
        # 2. reshard, on the new default group (pg ranks of logical ranks via members)
        states = state_names(self.opt_states) if agreed.moments else ("param",)
        rplan = self.prepare(new_plan, alive if alive is not None else self.members, states, stock=False)
        inflight = start_reshard(
            rplan, self.rank, {s: shards.get(s, {}) for s in states}, new_plan, self.specs, dist.group.WORLD,
            pg_rank_of=self.pg_rank_of(), timeout=timedelta(seconds=self.timeout_s), stats=stats,
        )
        # the new plan's groups while the pieces are on the wire: creating a group waits on
        # peers (store round trips, connections), not on this rank's CPU, and gloo's own
        # threads move the pieces meanwhile
        made = {**self._make_groups(new_plan, kept_sets), **kept}
        new_shards = inflight.finish()
        t2 = time.perf_counter()
        # 3. rebuild the runtime for the new plan and load the state
        self.plan = new_plan
        self.epoch = epoch
        self._build(new_plan, init_weights=False, made=made)
        if self.runtime is not None:
            load_shards(self.runtime, new_shards, agreed.optimizer_steps if agreed.moments else 0.0)
        # no closing barrier: a rank that is ready waits in its first message of the new epoch,
        # and a peer still resharding has already received all it needs from it (the executor
        # returns only once its sends completed); reshard and pipeline messages differ by tag
        t3 = time.perf_counter()
        report = ReconfigReport(
            epoch=epoch, role="member" if self.runtime is not None else "spare", regroup_s=t1 - t0,
            reshard_s=t2 - t1, rebuild_s=t3 - t2, bytes_moved=rplan.bytes_moved, bytes_local=rplan.bytes_local,
            downtime_s=t3 - t0, reshard=rplan, groups_kept=len(kept), world_kept=keep, next_step=agreed.next_step,
        )
        self.history.append(report)
        if log.isEnabledFor(logging.INFO):  # the summary walks every transfer
            log.info("[rank %d epoch %d] reconfigured (%s): %s; %.3f s", self.rank, epoch, report.role,
                     rplan.summary(), report.downtime_s)
        return report

    def on_reconfigure(self) -> Callable[[Any, Any], None]:
        """A handler for ``Job.on_reconfigure``: applies a ReconfigCommand and updates the job."""

        def handler(job: Any, cmd: Any) -> None:
            self.apply(cmd.plan, cmd.epoch)
            job.plan = self.plan
            job.runtime = self.runtime

        return handler
