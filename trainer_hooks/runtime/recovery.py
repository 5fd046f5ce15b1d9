"""Fail-stop recovery of the resilient loop, and the all-or-nothing steps of any switch.

A step (or a planned switch) that loses a peer makes every survivor shrink the MPI world
(ULFM), agree on the last step all of them completed, roll back past it, take the
coordinator's plan (the first survivor waits for it and broadcasts it; without one the
``survivor_plan`` rule), reshard from surviving replicas or, where none holds a lost slice,
restore the latest checkpoint, and resume at the agreed step + 1. ULFM's Agree decides
whether every survivor finished a switch: if one did not, all go back to the plan they
started from and recover from there; a recovery that loses another peer starts over, at
most ``max_recoveries`` times in a row. ``Resilience`` (runtime.resilient) inherits this;
it is split out only to keep modules small.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.agreement import BoundaryAgreement
from resihp.trainer_hooks.reconfig.failstop import (
    SPARE_STEP,
    StepGuard,
    abandon_groups,
    survivor_plan,
)
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, ReconfigReport
from resihp.trainer_hooks.reconfig.reshard import ReshardError
from resihp.trainer_hooks.reconfig.timeouts import lengthen_timeouts
from resihp.trainer_hooks.reconfig.transfer import Shards
from resihp.trainer_hooks.reconfig.ulfm import MpiWorld, RecoveryError, failed_processes, is_peer_failure, shrink
from resihp.trainer_hooks.reporting.deaths import DEATHS, PeerDeathListener
from resihp.trainer_hooks.runtime.gc_control import paused
from resihp.trainer_hooks.runtime.groups import retire
from resihp.trainer_hooks.runtime.progress_log import ProgressLog, loss_rank

if TYPE_CHECKING:
    from resihp.trainer_hooks.hooks import Job

log = logging.getLogger(__name__)


class JobStopped(RuntimeError):
    """The job cannot go on (no survivor holds a lost shard, or failures kept coming)."""


PREPARE_AHEAD_ENV = "RESIHP_PREPARE_AHEAD"  # on | off | auto (default)


def prepare_ahead_wanted(env: Mapping[str, str]) -> bool:
    """Whether a fail-stop plan is prepared ahead: ``on``, ``off``, or ``auto`` — where this
    node has a core per local rank. The preparation runs while the rank is blocked on its dead
    peer, on CPU that is idle only if the rank has a core to itself; on an oversubscribed host
    it takes CPU the other survivors need to notice the failure (bench/your_model.py on 2
    cores, 8 ranks: fail-stop downtime 0.248 / 0.194 s with it, 0.170 / 0.229 s without, same
    hour — noise either way)."""
    mode = env.get(PREPARE_AHEAD_ENV, "auto").strip().lower()
    if mode in ("on", "1", "true", "yes"):
        return True
    if mode in ("off", "0", "false", "no"):
        return False
    if mode != "auto":
        log.warning("%s=%r is not on, off or auto: taken as auto", PREPARE_AHEAD_ENV, env[PREPARE_AHEAD_ENV])
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or "1"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= (int(local) if local.isdigit() else 1)


class PrepareAhead(PeerDeathListener):
    """A fail-stop plan heard on the command thread (the coordinator's, typically tens of ms
    before this rank's own recovery reaches its reshard: it is still blocked on the dead peer,
    or shrinking) starts the reshard plan and the new stage module on a thread of its own, for
    the survivors the plan implies. The recovery's own ``prepare`` then finds it done or
    waits for it (``LiveReconfigurer.prepare`` holds a lock): its ``reshard.prepare`` phase,
    24–53 ms of a recovery in bench/chaos.py, leaves the critical path. If the survivors
    turn out otherwise, the recovery prepares for those it found, as before."""

    def __init__(self, rc: LiveReconfigurer) -> None:
        self.rc = rc
        self.enabled = prepare_ahead_wanted(os.environ)  # the job's environment: decided once
        self.started: list[int] = []  # epochs prepared ahead (tests, logs)
        DEATHS.on_peer_death(self)

    def __call__(self, cmd: m.ReconfigCommand, dead: frozenset[int]) -> None:
        rc = self.rc
        if not self.enabled:
            return
        if cmd.epoch <= rc.epoch or not dead & set(rc.members) or rc.rank in dead:
            return
        alive = tuple(sorted(set(rc.members) - dead))
        self.started.append(cmd.epoch)
        log.warning("rank %d: the coordinator's fail-stop plan (epoch %d) came first; preparing its reshard ahead "
                    "for survivors %s", rc.rank, cmd.epoch, list(alive))
        threading.Thread(target=self._prepare, args=(cmd.plan, alive), name="resihp-prepare-ahead",
                         daemon=True).start()

    def _prepare(self, plan: Plan, alive: tuple[int, ...]) -> None:
        try:
            self.rc.prepare(plan, alive=alive)
        except Exception as exc:  # noqa: BLE001 - the recovery prepares again and reports what fails
            log.info("rank %d: preparing the fail-stop plan ahead failed: %s", self.rc.rank, exc)


def is_failure(exc: BaseException) -> bool:
    """A peer died: the exception, or the one it was raised from, is a peer failure."""
    return is_peer_failure(exc) or (exc.__cause__ is not None and is_peer_failure(exc.__cause__))


def batch_change(old: Plan, new: Plan, tokens_per_microbatch: int) -> str:
    """Why ``new`` cannot replace ``old`` in a running job ("" if it can): a re-plan moves
    work between ranks, it never changes what one step trains — the same global batch, so
    the loss curve stays the one the job would have had. Token shares (``PipelinePlan.tokens``)
    count in tokens: their micro-batch counts may differ from the batch's."""
    b = tokens_per_microbatch
    if new.global_tokens(b) != old.global_tokens(b):
        return (f"the plan trains {new.batch_microbatches(b)} micro-batches per step and this job "
                f"{old.batch_microbatches(b)}: a re-plan may not change the global batch (was the coordinator started "
                f"with the training script's --microbatches?)")
    return ""


class FailStopRecovery:
    """The recovery half of ``Resilience``: shrink, agree, re-plan, reshard or restore, resume."""

    # the loop's state this part reads and writes (fields of Resilience)
    job: Job
    rc: LiveReconfigurer
    world: MpiWorld
    plan_wait_s: float
    max_recoveries: int
    checkpoint_root: str | None
    last_done_before: int
    progress: ProgressLog | None
    guard: StepGuard
    next_step: int
    last_done: int
    failures: int
    history: list[dict[str, Any]]
    _last_step_end: float
    timeouts: list[tuple[int, float]]
    _notice: m.ReconfigCommand | None
    _deferred: list[m.ReconfigCommand]
    _tried_epoch: int
    _adopted_seq: int | None
    agreement: BoundaryAgreement | None

    # --- fail-stop --------------------------------------------------------------------
    def _recover(self, cause: BaseException) -> None:
        with paused():  # no garbage collection on the recovery's path (runtime/gc_control.py)
            self._recover_paused(cause)

    def _recover_paused(self, cause: BaseException) -> None:
        t0 = time.perf_counter()
        log.warning("rank %d: a peer failed (%s: %s); recovering", self.rc.rank, type(cause).__name__,
                    str(cause)[:160])
        abandon_groups(self.rc, cause)  # peers blocked on this rank fail at once instead of at their timeout
        assert self.agreement is not None
        self.agreement.reset()
        member = self.rc.runtime is not None
        last = self.last_done if member else SPARE_STEP
        shards: Shards | None = None
        adam = 0.0
        world = self.world
        before = self._snapshot()
        lost: set[int] = set()  # over every attempt of this recovery
        lengthened = False
        for attempt in range(1, self.max_recoveries + 1):
            shrunk = False
            # this rank's seconds per phase of the attempt that succeeds (the progress log's
            # ``phases_s``): where a recovery's time goes, rank by rank
            phases: dict[str, float] = {"detect": t0 - min(t0, self._last_step_end)}
            mark = time.perf_counter()

            def lap(name: str) -> None:
                nonlocal mark
                now = time.perf_counter()
                phases[name] = phases.get(name, 0.0) + now - mark
                mark = now

            try:
                world = shrink(replace(world, epoch=max(self.rc.epoch, self._tried_epoch)), last)
                lost |= set(world.failed)
                shrunk = True
                self.rc.failed_processes = functools.partial(failed_processes, world)
                lap("shrink")
                if shards is None:
                    shards, adam = self.guard.state_after(self.rc, world.agreed_step, self.last_done)
                    agreed = world.agreed_step
                plan = self._agree_plan(world)
                plan = replace(plan, epoch=max(plan.epoch, world.epoch))  # past every epoch tried
                if not lost and not lengthened:  # every peer lived: a wait outlasted the timeout
                    self.timeouts.append((self.last_done, lengthen_timeouts(self.rc)))
                    lengthened = True
                self._tried_epoch = max(self._tried_epoch, plan.epoch)
                lap("plan")
                restored_from: int | None = None
                try:
                    self.rc.prepare(plan, alive=world.ranks)  # the same verdict on every survivor
                    lap("reshard.prepare")
                except ReshardError as exc:  # no survivor holds some slice (DP = 1): the checkpoint
                    report, restored_from = self._restore_checkpoint(plan, world, exc)
                else:
                    report = self.rc.apply(plan, plan.epoch, old_shards=shards if member else {}, alive=world.ranks,
                                           members=world.ranks, adam_steps=adam)
                lap("reshard")
                # its parts (LiveReconfigurer.apply): the new default group; the state's transfers
                # with the new plan's groups made meanwhile; the runtime rebuilt on them
                phases.update({"reshard.regroup": report.regroup_s, "reshard.transfer+groups": report.reshard_s,
                               "reshard.rebuild": report.rebuild_s})
                if not self._commit(world.comm, True):
                    raise RecoveryError("a survivor lost a peer while resharding; every survivor starts over")
                lap("commit")
            except SpecError as exc:  # e.g. the coordinator's plan does not fit the survivors
                self._stop(f"recovery impossible: {exc}")
            except Exception as exc:  # noqa: BLE001 - another failure while recovering: go again
                if not is_failure(exc) and not isinstance(exc, RecoveryError):
                    raise
                log.warning("rank %d: failure during recovery attempt %d: %s", self.rc.rank, attempt, exc)
                if shrunk and not isinstance(exc, RecoveryError):
                    self._commit(world.comm, False)  # the peers that finished learn it from this verdict
                if isinstance(exc, RecoveryError) and attempt == self.max_recoveries:
                    self._stop(str(exc))
                self._revert(before)
                last = agreed if shards is not None else last
                continue
            self.world = world
            self.failures += 1
            self.next_step = agreed + 1 if agreed < SPARE_STEP else self.next_step
            if restored_from is not None:
                self.next_step = restored_from
                agreed = restored_from - 1
            self.last_done = min(self.last_done, agreed)
            self.guard = StepGuard()
            for cmd in self._deferred:  # the coordinator's plan the recovery took is in force; the rest superseded
                took = cmd.seq == self._adopted_seq
                self.job.transport.ack(cmd, self.next_step, ok=took, error="" if took else "superseded by recovery")
            self._deferred.clear()
            self._notice = None
            self.job.trace = None  # the MPI trace collector's communicator is gone; the coordinator keeps the trace
            why = f"lost ranks {sorted(lost)}; {plan.reason}"
            if restored_from is not None:
                again = (f"steps {restored_from}..{self.last_done_before} are trained again"
                         if self.last_done_before >= restored_from else "no step is lost")
                why = (f"lost ranks {sorted(lost)}, and no survivor held all of their state: restored from the "
                       f"checkpoint of step {restored_from - 1} ({again}); {plan.reason}")
            # the job's downtime: from this rank's last completed step (the failed step, the
            # detection wait and the recovery) to ready on the new plan
            self._adopt(report, "fail-stop" if restored_from is None else "fail-stop-checkpoint", why,
                        time.perf_counter() - min(t0, self._last_step_end), attempts=attempt, phases=phases)
            log.warning("rank %d: recovered in %.2f s: lost %s, resuming at step %d on %s (%s)", self.rc.rank,
                        time.perf_counter() - t0, sorted(lost), self.next_step, plan.describe(),
                        ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()))
            retire(before)
            del before
            return
        self._stop(f"{self.max_recoveries} failures in a row during recovery")

    def _restore_checkpoint(self, plan: Plan, world: MpiWorld, why: Exception) -> tuple[ReconfigReport, int]:
        from resihp.trainer_hooks.checkpoint.saver import latest_checkpoint, restore_live

        path = latest_checkpoint(self.checkpoint_root) if self.checkpoint_root else None
        if path is None:
            self._stop(f"recovery impossible: {why}; and there is no checkpoint to fall back on "
                       f"(train with checkpoints, e.g. examples/train_gpt.py --checkpoint-dir DIR)")
        log.warning("rank %d: %s; restoring from %s", self.rc.rank, why, path)
        self.last_done_before = self.last_done
        return restore_live(self.rc, plan, plan.epoch, path, members=world.ranks)

    def _agree_plan(self, world: MpiWorld) -> Plan:
        """The survivors' plan: the coordinator's (received by the first survivor, broadcast), else
        the deterministic survivor rule."""
        payload: dict[str, Any] | None = None
        if world.comm.Get_rank() == 0:
            # nobody lost (e.g. the store was restarted under a boundary's agreement): no plan is
            # coming from the coordinator, which saw no death; the same layout on a new epoch
            cmd = self._wait_coordinator_plan(world) if world.failed else None
            if cmd is not None:
                payload = {"plan": cmd.plan.to_dict(), "epoch": cmd.epoch, "source": "coordinator", "seq": cmd.seq}
            else:
                epoch = max(world.epoch, self.rc.epoch + 1)
                rule = survivor_plan(self.rc.plan, world.ranks, self.rc.spec, epoch, self.rc.config.budget)
                payload = {"plan": rule.to_dict(), "epoch": epoch, "source": "survivor rule"}
        payload = world.comm.bcast(payload, root=0)
        assert payload is not None
        plan = replace(Plan.from_dict(payload["plan"]), epoch=int(payload["epoch"]))
        # a spare that died since the plan was made (a planned switch's plan, its spare killed
        # inside it) is simply no spare any more: every survivor drops it alike
        plan = replace(plan, spares=tuple(r for r in plan.spares if r in world.ranks))
        self._adopted_seq = payload.get("seq")
        log.info("rank %d: recovery plan from the %s: %s", self.rc.rank, payload["source"], plan.describe())
        return plan

    def _wait_coordinator_plan(self, world: MpiWorld) -> m.ReconfigCommand | None:
        """A ReconfigCommand newer than our epoch whose plan uses only survivors (the coordinator
        learns of a death from the node agent, usually before the survivors do)."""
        alive = set(world.ranks)
        deadline = time.monotonic() + self.plan_wait_s
        heard = DEATHS.version
        while True:
            self.job._pending.extend(self.job.transport.poll_commands())
            fits = [c for c in [*self._deferred, *self.job._pending] if isinstance(c, m.ReconfigCommand)
                    and c.epoch > self.rc.epoch and set(c.plan.ranks()) <= alive]
            if fits:
                best = max(fits, key=lambda c: c.epoch)
                refused = batch_change(self.rc.plan, best.plan, self.rc.config.budget)
                if refused:  # a coordinator started with another layout: keep the job's batch
                    log.error("rank %d: the coordinator's recovery plan is refused: %s; using the survivor rule",
                              self.rc.rank, refused)
                    self.job._pending = [c for c in self.job._pending if c not in fits]
                    self._deferred = [c for c in self._deferred if c not in fits]
                    for c in fits:  # said, not left pending: it must never be acknowledged as applied
                        self.job.transport.ack(c, self.last_done + 1, ok=False, error=refused)
                    return None
                if best not in self._deferred:
                    self._deferred.append(best)
                self.job._pending = [c for c in self.job._pending if c not in fits]
                return best
            if time.monotonic() > deadline:
                log.warning("rank %d: no plan from the coordinator within %.0f s; using the survivor rule",
                            self.rc.rank, self.plan_wait_s)
                return None
            heard = DEATHS.wait(0.05, heard)  # the coordinator's fail-stop plan wakes this at once

    def _stop(self, why: str) -> NoReturn:
        log.error("rank %d: the job stops: %s", self.rc.rank, why)
        if self.progress is not None:
            self.progress.write("stopped", rank=self.rc.rank, reason=why, step=self.last_done)
        raise JobStopped(why)

    # --- all or nothing ---------------------------------------------------------------
    def _snapshot(self) -> tuple[Plan, int, tuple[int, ...], Any]:
        return self.rc.plan, self.rc.epoch, tuple(self.rc.members), self.rc.runtime

    def _revert(self, before: tuple[Plan, int, tuple[int, ...], Any]) -> None:
        """Back to the plan (and runtime, whose tensors the switch only read) a failed switch started from."""
        abandon_groups(self.rc)
        self.rc.plan, self.rc.epoch, members, self.rc.runtime = before
        self.rc.members = members

    def _commit(self, comm: Any, ok: bool) -> bool:
        """Whether every survivor finished the switch: ULFM's Agree gives every survivor the same
        verdict (and fails on all of them alike when a peer died), so no rank goes on with the
        new plan while another starts over from the old one."""
        try:
            return bool(comm.Agree(1 if ok else 0))
        except Exception as exc:  # noqa: BLE001 - MPI's proc-failed / revoked
            if not is_failure(exc):
                raise
            log.warning("rank %d: a peer failed before the switch was agreed: %s", self.rc.rank, exc)
            return False


    def _adopt(self, report: ReconfigReport, kind: str, reason: str, downtime_s: float, attempts: int = 1,
               phases: dict[str, float] | None = None) -> None:
        """The switched plan is the job's: its runtime, an entry in ``history``, a progress-log line."""
        self.job.plan = self.rc.plan
        self.job.runtime = self.rc.runtime
        entry: dict[str, Any] = {
            "kind": kind, "epoch": self.rc.epoch, "step": self.next_step, "downtime_s": round(downtime_s, 4),
            "bytes_moved": report.bytes_moved, "plan": self.rc.plan.describe(), "reason": reason,
            "role": report.role, "attempts": attempts}
        if phases:
            entry["phases_s"] = {k: round(v, 4) for k, v in phases.items()}
        self.history.append(entry)
        if self.progress is not None and self.rc.runtime is not None and self.rc.rank == loss_rank(self.rc.plan):
            self.progress.write("reconfig", **entry)
