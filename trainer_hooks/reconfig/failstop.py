"""Fail-stop recovery through the live-reconfiguration path.

When a rank dies mid-step, every survivor ends up here: members because a gloo collective
or point-to-point message of the step failed (connection reset on ranks wired to the dead
one within milliseconds; the group's short timeout on the others), spares because their
idle MPI receive fails or is revoked. ``recover``:

1. **shrink** — ULFM ``Revoke`` + ``Shrink`` + agreement (``ulfm.shrink``) give the
   survivors a communicator, the dead ranks, and the last step EVERY survivor completed;
2. **roll back** — a survivor that completed a step the others did not restores the copy
   of its state taken before that step (``StepGuard``); a half-done step is never applied
   (the optimizer step is the last, local, action of a step, so a rank that saw the failure
   still holds its pre-step state);
3. **replan** — ``survivor_plan``: a simple deterministic rule, documented below, not the
   coordinator's search;
4. **regroup + reshard + rebuild** — ``LiveReconfigurer.apply`` on the survivors' new world
   (fresh store prefix, hosted outside the trainers), with the dead ranks' shards taken from
   a surviving data-parallel replica;

and training resumes at the agreed step + 1, so no sample is lost or trained twice.
"""
from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from resihp.coordinator.model.plan import PipelinePlan, Plan, even_split
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, ReconfigReport, optimizer_steps, runtime_shards
from resihp.trainer_hooks.reconfig.timeouts import lengthen_timeouts
from resihp.trainer_hooks.reconfig.transfer import Shards
from resihp.trainer_hooks.reconfig.ulfm import MpiWorld, RecoveryError, shrink
from resihp.trainer_hooks.runtime.groups import retire_each

log = logging.getLogger(__name__)
SPARE_STEP = 1 << 62  # the "last completed step" a spare reports in the agreement


def survivor_plan(old: Plan, alive: Sequence[int], spec: ModelSpec, epoch: int, tokens_per_microbatch: int = 0) -> Plan:
    """The layout the survivors switch to (a deterministic rule, not a search).

    - TP size: the old plan's (halved until at least one group can be formed);
    - TP groups: the old groups whose members all survived, in plan order, then the other
      survivors (members of broken groups and spares) in rank order, ``tp`` at a time;
      survivors left over become spares;
    - pipeline depth: the ``pp`` that puts the most groups to work (``pp · ⌊n/pp⌋``), ties
      to the old depth's nearest, then the shallower; ``dp = ⌊n/pp⌋``;
    - layers split evenly over the stages, the global batch's micro-batches evenly over the
      replicas (so every replica runs the whole model and the global batch is unchanged).
    """
    alive_set = set(alive)
    old_groups = [g for rep in old.replicas for g in rep.stages]
    tp = max(len(g) for g in old_groups)
    old_pp = old.replicas[0].pp
    while True:
        groups = [g for g in old_groups if len(g) == tp and set(g) <= alive_set]
        used = {r for g in groups for r in g}
        rest = sorted(alive_set - used)
        groups += [tuple(rest[i:i + tp]) for i in range(0, len(rest) - tp + 1, tp)]
        if groups or tp == 1:
            break
        tp //= 2
    if not groups:
        raise SpecError(f"recovery: no rank survived ({sorted(alive_set)})")
    n = len(groups)
    candidates = [pp for pp in range(1, min(n, spec.num_layers) + 1)]
    pp = max(candidates, key=lambda p: (p * (n // p), -abs(p - old_pp), -p))
    dp = n // pp
    layers = tuple(even_split(spec.num_layers, pp))
    shares = even_split(old.batch_microbatches(tokens_per_microbatch), dp)  # whole micro-batches again
    replicas = tuple(PipelinePlan(tuple(groups[d * pp:(d + 1) * pp]), layers, shares[d]) for d in range(dp))
    members = {r for rep in replicas for r in rep.ranks()}
    plan = Plan(replicas=replicas, epoch=epoch, spares=tuple(sorted(alive_set - members)),
                reason=f"fail-stop: lost {sorted(set(old.ranks()) - alive_set)}")
    plan.validate_for(spec.num_layers, spec.num_heads)
    return plan


@dataclass
class _Saved:
    step: int  # the step this state is the state BEFORE
    shards: Shards
    adam_steps: float


class StepGuard:
    """Keeps this rank's state from before the last two steps, for a rollback.

    Two, because pipeline stages drift by one completed step: when a rank dies in step s,
    a last-stage rank of its replica may already have completed s and entered s + 1 while
    the dead rank's TP partner completed only s − 1; the agreement is then s − 1, and the
    ahead rank needs its state from before step s."""

    def __init__(self, depth: int = 2) -> None:
        self._saved: list[_Saved] = []
        self.depth = depth

    def before_step(self, rc: LiveReconfigurer, step: int) -> None:
        if rc.runtime is None:
            self._saved = []
            return
        keep = [s for s in self._saved if s.step < step][-(self.depth - 1):] if self.depth > 1 else []
        self._saved = keep + [_Saved(step, runtime_shards(rc.runtime, clone=True), optimizer_steps(rc.runtime))]

    def state_after(self, rc: LiveReconfigurer, agreed_step: int, last_step: int) -> tuple[Shards, float]:
        """This rank's state as it was at the end of ``agreed_step``."""
        if rc.runtime is None:
            return {}, 0.0
        if last_step == agreed_step:
            return runtime_shards(rc.runtime), optimizer_steps(rc.runtime)
        saved = next((s for s in self._saved if s.step == agreed_step + 1), None)
        if saved is None or last_step < agreed_step:
            kept = [s.step for s in self._saved]
            raise RecoveryError(
                f"rank {rc.rank}: completed step {last_step} but the survivors agreed on {agreed_step}, and only the "
                f"state before steps {kept} was kept; recover from a checkpoint"
            )
        log.warning("rank %d: rolling back to the end of step %d (not every survivor completed step %d)", rc.rank,
                    agreed_step, agreed_step + 1)
        return saved.shards, saved.adam_steps


def release_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (its causes too): the
    frame of a failed collective holds the process group, whose connections then stay open
    and keep this rank's peers waiting out their timeout. The traceback itself (for logs)
    stays."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def abandon_groups(rc: LiveReconfigurer, cause: BaseException | None = None) -> None:
    """After a peer failure: tear down this rank's groups and let go of every reference to
    them (``Runtime.let_go_of_groups``, the default group, the failed call's frames in
    ``cause``); the old runtime stays, for its tensors. The groups' destructors then close
    their connections at once, each on a thread of its own, so peers blocked on this rank (TP, DP, loss, the
    pipeline's neighbour pairs) fail now instead of at their timeout, and do the same: gloo's
    ``abort`` does not wake them. The default group keeps ≈ 10 references nobody here holds,
    which is why nothing that must wake a peer runs on it."""
    release_frames(cause)
    held: list[Any] = []
    try:
        if rc.runtime is not None:
            held += rc.runtime.let_go_of_groups()
        if dist.is_initialized():
            held.append(c10d._get_default_group())
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - tearing down a broken group may itself fail
        log.info("rank %d: tearing down the broken groups: %s", rc.rank, exc)
    retire_each(held)  # every connection closes at once: each blocked peer fails now


@dataclass
class Recovery:
    world: MpiWorld
    plan: Plan
    resume_at: int  # first step to (re)run
    report: ReconfigReport
    detect_to_ready_s: float
    shrink_s: float


def recover(rc: LiveReconfigurer, world: MpiWorld, last_step: int, guard: StepGuard,
            detected_at: float | None = None,
            choose_plan: Callable[[MpiWorld], Plan] | None = None,
            cause: BaseException | None = None) -> Recovery:
    """Everything a survivor does after seeing a peer die; collective over the survivors.

    First it lets go of this rank's groups (``abandon_groups``; ``cause``: the exception
    that reported the failure, whose frames hold the failed call's group), so that peers
    still blocked on this rank fail at once and join the recovery.
    ``choose_plan(new_world)``: the survivors' next plan (epoch included), identical on every
    survivor — e.g. the coordinator's, received by one survivor and broadcast; default
    ``survivor_plan``."""
    t0 = detected_at if detected_at is not None else time.perf_counter()
    abandon_groups(rc, cause)
    t_shrink = time.perf_counter()
    # a spare trains nothing: it must not hold the agreement (a minimum) back
    new_world = shrink(replace(world, epoch=rc.epoch), last_step if rc.runtime is not None else SPARE_STEP)
    shrink_s = time.perf_counter() - t_shrink
    agreed = new_world.agreed_step
    if not new_world.failed:
        lengthen_timeouts(rc)
    shards, adam_steps = guard.state_after(rc, agreed, last_step)
    plan = (choose_plan(new_world) if choose_plan is not None
            else survivor_plan(rc.plan, new_world.ranks, rc.spec, new_world.epoch, rc.config.budget))
    log.warning("rank %d: lost %s; resuming at step %d on %s", rc.rank, list(new_world.failed), agreed + 1,
                plan.to_dict())
    report = rc.apply(plan, plan.epoch, old_shards=shards, alive=new_world.ranks, members=new_world.ranks,
                      adam_steps=adam_steps)
    return Recovery(new_world, plan, agreed + 1, report, time.perf_counter() - t0, shrink_s)


__all__ = ["survivor_plan", "StepGuard", "Recovery", "recover", "abandon_groups", "release_frames", "lengthen_timeouts"]

