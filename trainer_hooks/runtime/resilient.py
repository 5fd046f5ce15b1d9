"""The resilient training loop behind ``Job.iterations`` and ``Job.train_step``.

``hooks.init`` installs a ``Resilience`` when the job runs a plan on the runtime and the
rendezvous store lives outside the trainers (``resihp launch`` hosts it and sets
``$RESIHP_STORE``). It makes three things work without more calls in the user's loop:

- **planned reconfiguration** — a coordinator ``ReconfigCommand`` is applied at its
  ``apply_at`` boundary by ``LiveReconfigurer`` (regroup, reshard, rebuild); a rank the
  new plan leaves out idles as a spare inside ``iterations`` (it joins every later
  switch once a member announces it in the store, and a plan that readmits it puts it back
  to work at the members' next step; a switch the job ends before is acknowledged as not
  applied);
- **fail-stop recovery** — a step that fails because a peer died (gloo reports a closed
  connection, MPI a failed or revoked communicator), or the coordinator's notice that a
  rank died, makes every survivor shrink the MPI world (ULFM), agree on the last step all
  of them completed, roll back past it, take the coordinator's new plan (the first
  survivor waits for it and broadcasts it; without one the documented
  ``survivor_plan`` rule), reshard from surviving replicas, and resume at the agreed step
  + 1: no sample lost or trained twice;
- **a second failure during recovery** — a peer lost while shrinking, agreeing or
  resharding restarts the recovery on the smaller world from the same rolled-back state
  (at most ``max_recoveries`` times in a row); when no survivor holds a lost shard the
  job stops with the reason in the progress log;
- **idle ranks are observed** — a spare times a compute probe every ``probe_every_s`` and
  reports it, so the detector can tell a slow spare from a recovered one
  (trainer_hooks/runtime/probe.py).

The recovery and the all-or-nothing steps of a switch are in ``runtime.recovery``, the
progress log in ``runtime.progress_log``.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.exit_status import leave_now
from resihp.trainer_hooks.reconfig.agreement import BoundaryAgreement, Holding, holding_of
from resihp.trainer_hooks.reconfig.failstop import StepGuard
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.reconfig.timeouts import TimeoutRestore, restore_timeouts
from resihp.trainer_hooks.reconfig.ulfm import MpiWorld, failed_processes
from resihp.trainer_hooks.reconfig.world import connect_store
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.reporting.opcursor import CURSOR
from resihp.trainer_hooks.runtime.groups import retire
from resihp.trainer_hooks.runtime.probe import ComputeProbe
from resihp.trainer_hooks.runtime.progress_log import ProgressLog
from resihp.trainer_hooks.runtime.recovery import FailStopRecovery, PrepareAhead, batch_change, is_failure
from resihp.trainer_hooks.runtime.trainer import StepResult

if TYPE_CHECKING:
    from resihp.trainer_hooks.hooks import Job

log = logging.getLogger(__name__)
END_TAG = 4243  # members -> spares: the job reached its last step
FENCED_EXIT_CODE = 75  # a rank declared dead that woke up (it is SIGKILLed; the code is for a bare os exit)


@dataclass
class Resilience(FailStopRecovery):
    job: Job
    rc: LiveReconfigurer
    world: MpiWorld
    plan_wait_s: float = 20.0  # how long the first survivor waits for the coordinator's plan
    max_recoveries: int = 3
    spare_join_timeout_s: float = 120.0
    checkpoint_root: str | None = None  # where the job's checkpoints are (the DP = 1 fallback)
    # an idle spare times a compute probe this often and reports it (trainer_hooks/runtime/probe.py)
    probe: ComputeProbe | None = None
    probe_every_s: float = 30.0
    last_done_before: int = -1
    progress: ProgressLog | None = None
    guard: StepGuard = field(default_factory=StepGuard)
    next_step: int = 0
    last_done: int = -1
    failures: int = 0  # recoveries so far
    history: list[dict[str, Any]] = field(default_factory=list)
    _last_step_end: float = field(default_factory=time.perf_counter)
    _notice: m.ReconfigCommand | None = None  # the coordinator said a rank died
    _deferred: list[m.ReconfigCommand] = field(default_factory=list)
    # the newest epoch any switch attempt used (a failed attempt's store prefix is never reused)
    _tried_epoch: int = -1
    _adopted_seq: int | None = None  # the coordinator command whose plan the last recovery took
    # members agree at which boundary a command applies (trainer_hooks/reconfig/agreement.py)
    agreement: BoundaryAgreement | None = None
    _round_epoch: int | None = None  # the epoch of the round collected at this boundary
    _stall: BaseException | None = None  # the members went silent at a boundary: recover
    _prepare_ahead: PrepareAhead | None = None
    # the groups' timeout after each change (step, seconds): lengthened by a recovery that lost
    # nobody, restored after short steps (reconfig/timeouts.py)
    timeouts: list[tuple[int, float]] = field(default_factory=list)
    _base_timeouts: tuple[float, float | None] = field(init=False)
    _restore: TimeoutRestore = field(init=False)

    def __post_init__(self) -> None:
        self._prepare_ahead = PrepareAhead(self.rc)  # held here: the notices hold it weakly
        # a switch's store waits also end on MPI's word that a member's process failed (a job
        # without a coordinator gets no death notice); the recovery points it at each new world
        self.rc.failed_processes = functools.partial(failed_processes, self.world)
        self._base_timeouts = (self.rc.timeout_s, self.rc.group_timeout_s)
        self._restore = TimeoutRestore(self._group_timeout_s())
        if self.agreement is None:
            timeout = max(4.0 * self.rc.timeout_s, 30.0)
            self.agreement = BoundaryAgreement(lambda: connect_store(self.rc.store_addr, timeout), self.rc.rank,
                                               timeout)

    # --- the loop ---------------------------------------------------------------------
    def iterations(self, total: int, start: int = 0) -> Iterator[int]:
        """The steps this rank runs, in order; rewinds after a rollback; idles while a spare."""
        self.next_step = max(self.next_step, start)
        while self.next_step < total:
            if self.rc.runtime is None:
                self._idle_as_spare(total)
                continue
            yield self.next_step
        self._unapplied_at_end(self.next_step)
        self._release_spares(total)

    def train_step(self, step: int) -> StepResult | None:
        """One step of the runtime; None when a peer died during it (the job has recovered and
        ``iterations`` resumes at the agreed step)."""
        if self._notice is not None:  # the coordinator saw a rank die before any collective did
            self._recover(RuntimeError(f"coordinator notice: {self._notice.reason}"))
            return None
        if self._stall is not None:
            stall, self._stall = self._stall, None
            self._recover(stall)
            return None
        self.guard.before_step(self.rc, step)
        started = time.perf_counter()
        try:
            result = self.rc.train_step(step)
        except Exception as exc:  # noqa: BLE001 - classified by is_failure
            if not is_failure(exc):
                raise
            self._recover(exc)
            return None
        self.last_done = step
        self.next_step = step + 1
        self._last_step_end = time.perf_counter()
        if self._restore.after_step(self._last_step_end - started, self._group_timeout_s()):
            restore_timeouts(self.rc, *self._base_timeouts)
            self.timeouts.append((step, self._group_timeout_s()))
        return result

    def _group_timeout_s(self) -> float:
        return self.rc.group_timeout_s if self.rc.group_timeout_s is not None else self.rc.timeout_s

    # --- commands ---------------------------------------------------------------------
    def agreed_at(self, iteration: int) -> Holding | None:
        """What every member held at the previous boundary (None: no round outstanding, e.g. just
        after a switch, or the coordinator reported a death while we waited)."""
        assert self.agreement is not None
        self._round_epoch = self.rc.epoch
        try:
            return self.agreement.collect(give_up=self._death_reported)
        except Exception as exc:  # noqa: BLE001 - silent members: treated as a failed peer
            log.warning("rank %d: at boundary %d: %s", self.rc.rank, iteration, exc)
            self._stall = exc
            return None

    def post_round(self, iteration: int, pending: list[m.Command]) -> None:
        """Post this member's holding at boundary ``iteration``, unless this boundary switched
        plans or found a failure (then every member starts over at its next boundary)."""
        assert self.agreement is not None
        if self.rc.runtime is None or self.rc.epoch != self._round_epoch or self._notice is not None \
                or self._stall is not None:
            self.agreement.reset()
            return
        self.agreement.post(self.rc.epoch, iteration, self.rc.plan.ranks(),
                            holding_of(pending, self.rc.epoch, self.rc.rank))

    def _death_reported(self) -> bool:
        self.job._pending.extend(self.job.transport.poll_commands())
        return any(isinstance(c, m.ReconfigCommand) and c.reason.startswith("fail-stop") and c.epoch > self.rc.epoch
                   for c in self.job._pending)

    def on_command_received(self, job: Job, cmd: m.ReconfigCommand) -> None:
        """Job.on_command_received: prepare a planned switch while its apply_at is ahead (the
        reshard plan and the new stage module); the switch itself redoes whatever this could
        not (a plan the current world cannot take is refused there, with its reason)."""
        if cmd.reason.startswith("fail-stop"):
            return  # the recovery plans on the survivors it finds
        try:
            self.rc.prepare(cmd.plan)
        except SpecError as exc:
            log.info("rank %d: could not prepare epoch %d ahead: %s", self.rc.rank, cmd.epoch, exc)
    def on_reconfigure(self, job: Job, cmd: m.ReconfigCommand) -> bool:
        """Job.on_reconfigure: False defers the acknowledgement (a fail-stop plan is applied by
        the recovery, which acknowledges it)."""
        if cmd.epoch <= self.rc.epoch:
            return True  # already in force (the recovery applied it): acknowledge
        dropped = set(self.rc.members) - set(cmd.plan.ranks()) - set(cmd.plan.spares)
        if dropped and cmd.reason.startswith("fail-stop"):  # the coordinator's mark: they died
            log.warning("rank %d: coordinator reports ranks %s gone (epoch %d); recovering", self.rc.rank,
                        sorted(dropped), cmd.epoch)
            self._notice = cmd
            self._deferred.append(cmd)
            return False
        refused = batch_change(self.rc.plan, cmd.plan, self.rc.config.budget)
        if refused:
            raise ValueError(refused)  # every rank refuses alike: the acknowledgement says why
        was_member = self.rc.runtime is not None
        if was_member:
            self._announce_switch(cmd.epoch)
        elif not self._switch_announced(cmd.epoch):
            # an idle spare enters the new epoch's rendezvous only once the members do: their
            # apply_at may lie beyond the job's last step, and a spare blocked in a rendezvous
            # could not hear that the job ended
            self.job._pending.append(cmd)
            return False
        t0 = time.perf_counter()
        saved_timeout = self.rc.timeout_s
        if not was_member:  # the members announced the switch; a slow spare may reach the rendezvous late
            self.rc.timeout_s = max(saved_timeout, self.spare_join_timeout_s)
        before = self._snapshot()
        failure: BaseException | None = None
        self._tried_epoch = max(self._tried_epoch, cmd.epoch)
        try:
            with CURSOR.op("collective", f"switch to epoch {cmd.epoch}"):  # a hang here is located too
                report = self.rc.apply(cmd.plan, cmd.epoch, next_step=self.next_step if was_member else -1)
        except Exception as exc:  # noqa: BLE001 - a peer died during the switch: recover instead
            if not is_failure(exc):
                raise
            failure = exc
        finally:
            self.rc.timeout_s = saved_timeout
        applied = time.perf_counter()
        if not self._commit(self.world.comm, failure is None):
            # someone lost a peer mid-switch: every rank goes back to the old plan's state
            # (those that finished too) and recovers from there, on the same footing
            self._revert(before)
            self._deferred.append(cmd)  # superseded by the recovery's plan; acknowledged there
            self._recover(failure or RuntimeError("a peer failed during the planned switch"))
            return False
        # every rank resumes at the members' next step (a readmitted spare learns it from their
        # arrival: no collective after the commit, where a peer's death would reach no handler)
        self.next_step = report.next_step
        done = time.perf_counter()
        # where a planned switch's time goes, as a recovery's (the progress log's ``phases_s``):
        # regroup holds the wait for every member to arrive, and what apply does before it
        phases = {"regroup": applied - t0 - report.reshard_s - report.rebuild_s, "transfer+groups": report.reshard_s,
                  "rebuild": report.rebuild_s, "commit": done - applied}
        self._adopt(report, "planned", cmd.reason, done - t0, phases=phases)
        retire(before)  # the old runtime's last reference: its groups' teardown runs off this thread
        del before
        return True

    # --- spares -----------------------------------------------------------------------
    def _announce_switch(self, epoch: int) -> None:
        """A member is about to enter epoch ``epoch``'s rendezvous (the idle spares wait for this)."""
        self.rc.store().set(switch_key(epoch), str(self.rc.rank))

    def _switch_announced(self, epoch: int) -> bool:
        return bool(self.rc.store().check([switch_key(epoch)]))

    def _idle_as_spare(self, total: int) -> None:
        """Wait, holding no state, for the end of the job, a plan that readmits this rank (applied
        collectively), or a failure (the communicator is revoked)."""
        req = self.world.comm.irecv(source=_any_source(), tag=END_TAG)
        next_probe = time.monotonic() + self.probe_every_s
        heard = DEATHS.version
        while True:
            try:
                done, value = req.test()
            except Exception as exc:  # noqa: BLE001 - MPI's revoke / proc-failed
                if not is_failure(exc):
                    raise
                self._recover(exc)
                return
            if done:
                self.next_step = max(int(value), total)
                self._unapplied_at_end(self.next_step)
                return
            try:
                outcome = self.job._apply_commands(self.next_step - 1, force=True)
            except Exception as exc:  # noqa: BLE001
                if not is_failure(exc):
                    raise
                self._recover(exc)
                return
            if self._notice is not None:
                self._recover(RuntimeError(f"coordinator notice: {self._notice.reason}"))
                return
            if self.rc.runtime is not None or outcome.stop:
                _cancel(req)
                if outcome.stop:
                    self.next_step = total
                return
            if self.probe is not None and time.monotonic() >= next_probe:
                # nothing else tells the detector whether this device is slow or healthy
                self.job.transport.probe(self.probe.run())
                next_probe = time.monotonic() + self.probe_every_s
            heard = DEATHS.wait(0.05, heard)  # an idle spare polls (it holds up nobody); a death wakes it

    def _unapplied_at_end(self, end: int) -> None:
        """Say why the plans still waiting for the members' switch were never applied."""
        for cmd in self.job._pending:
            if isinstance(cmd, m.ReconfigCommand) and cmd.epoch > self.rc.epoch:
                why = (f"{m.JOB_ENDED}at step {end}, before the members reached iteration {cmd.apply_at}, where "
                       f"epoch {cmd.epoch} was to apply; not applied")
                log.info("rank %d: %s", self.rc.rank, why)
                self.job.transport.ack(cmd, end, ok=False, error=why)
        self.job._pending = [c for c in self.job._pending
                             if not (isinstance(c, m.ReconfigCommand) and c.epoch > self.rc.epoch)]

    def _release_spares(self, total: int) -> None:
        """The first member tells every spare that the job is over (they wait on a message)."""
        if self.rc.runtime is None:
            return
        members = [r for r in self.rc.members if self.rc.plan.has_rank(r)]
        if self.rc.rank != min(members):
            return
        comm_of = {r: i for i, r in enumerate(self.world.ranks)}
        for r in self.rc.members:
            if not self.rc.plan.has_rank(r) and r in comm_of:
                try:
                    self.world.comm.send(total, dest=comm_of[r], tag=END_TAG)
                except Exception as exc:  # noqa: BLE001 - a dead spare needs no goodbye
                    log.warning("rank %d: could not tell spare %d the job ended: %s", self.rc.rank, r, exc)


def fenced_exit(rank: int, cmd: m.ReconfigCommand) -> NoReturn:
    """This rank was declared dead (it was stopped or stuck long enough for the job to go on
    without it) and has woken up: its epoch is stale. It leaves at once, touching no shared
    state — the survivors hold the job's state now."""
    log.error("rank %d: this rank was declared dead and fenced (epoch %d: %s); its state is stale, the job "
              "went on without it: exiting without touching shared state", rank, cmd.epoch, cmd.reason[:200])
    leave_now(FENCED_EXIT_CODE, as_failed_process=True)


def switch_key(epoch: int) -> str:
    """The store key a member sets right before it enters epoch ``epoch``'s rendezvous."""
    return f"resihp/switch/epoch{epoch}"


def _any_source() -> int:
    from mpi4py import MPI

    return int(MPI.ANY_SOURCE)


def _cancel(req: Any) -> None:
    try:
        req.Cancel()
    except Exception:  # noqa: BLE001 - a request that already completed cannot be cancelled
        pass
