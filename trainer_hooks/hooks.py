"""The two calls a training loop adds: ``init`` at start-up and ``Job.step`` every iteration.

    job = resihp.trainer_hooks.init("gpt-tiny", plan)         # MPI → torch.distributed, agent,
    for it in range(steps):                                   # groups, model + AdamW placed
        result = job.runtime.train_step(it)                   # the runtime's 1F1B step
        job.step(result)                                      # report; apply commands

A loop that keeps its own model (e.g. torch DDP, nanoGPT) passes no plan and reports what it
knows (trainer_hooks/own_loop.py):

    job = resihp.trainer_hooks.init(model=net)                # or a spec, preset, dict, file
    for it in range(steps):
        with job.timed("F"): loss = net(x, y)                 # this rank's own compute spans
        with job.timed("B"): loss.backward()
        job.step(loss=loss, tokens=tokens, seqlens=[[T]] * B) # a (B, T) batch: B sequences of T

``close`` runs by itself at a normal interpreter exit (and ``with init(...) as job:``). ``step`` never blocks on the network: reports go
to a bounded queue drained by a background thread (the agent client), the trace to a
non-blocking MPI send. It is the one place where commands take effect, at the step
boundary of their ``apply_at`` iteration: a ThrottleCommand (fault injection) now; a
ReconfigCommand is handed to ``Job.on_reconfigure`` where one is installed (live
reconfiguration) and otherwise refused with a reason in the acknowledgement.

Under ``resihp launch`` (the store outside the trainers) the job is resilient: loop with
``for it in job.iterations(steps): job.step(job.train_step(it))`` and a dead peer, a slow
rank or a readmission is handled inside those calls (trainer_hooks/runtime/resilient.py).
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.env_settings import THROTTLE_ENV, TRACE_ENV, parse_throttle_env, probe_interval
from resihp.trainer_hooks.exit_status import EXIT_STATUS, leave_now
from resihp.trainer_hooks.faults import arm_from_env
from resihp.trainer_hooks.launch.bootstrap import STORE_ENV, Bootstrap
from resihp.trainer_hooks.model_source import check_launch_model, resolve_model, spec_json
from resihp.trainer_hooks.own_loop import ChunkRecorder, ForwardTimer, Span
from resihp.trainer_hooks.reconfig.agreement import is_agreed_command
from resihp.trainer_hooks.reconfig.agreement import is_due as agreed_due
from resihp.trainer_hooks.reconfig.world import group_timeout
from resihp.trainer_hooks.reporting.deaths import DEATHS
from resihp.trainer_hooks.reporting.reporter import NullTransport, Transport, connect
from resihp.trainer_hooks.reporting.trace_writer import RankIteration, TraceCollector, make_header
from resihp.trainer_hooks.runtime.autolayout import (
    LAYOUT_PROFILE_ENV,
    AutoLayout,
    choice_line,
    planned_by_launcher,
    write_choice,
)
from resihp.trainer_hooks.runtime.autolayout import requested as requested_layout
from resihp.trainer_hooks.runtime.autolayout import table as layout_table
from resihp.trainer_hooks.runtime.gc_control import settle
from resihp.trainer_hooks.runtime.groups import wait_retired
from resihp.trainer_hooks.runtime.layout_timing import profile as profile_layouts
from resihp.trainer_hooks.runtime.probe import ComputeProbe
from resihp.trainer_hooks.runtime.progress_log import PROGRESS_ENV, ProgressLog, loss_rank
from resihp.trainer_hooks.runtime.resilient import Resilience, fenced_exit
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.trainer import Runtime, StepResult, TrainConfig

log = logging.getLogger(__name__)
@dataclass
class StepOutcome:
    iteration: int
    applied: tuple[str, ...] = ()  # kinds of the commands applied at this boundary
    stop: bool = False  # a DrainCommand asked the loop to end


@dataclass
class Job:
    """A rank's handle on the resilient job (returned by ``init``)."""

    boot: Bootstrap
    model: ModelSpec
    plan: Plan
    config: TrainConfig
    transport: Transport
    throttle: Throttle
    runtime: Runtime | None = None
    trace: TraceCollector | None = None
    on_reconfigure: Callable[[Job, m.ReconfigCommand], bool | None] | None = None  # False: ack later
    # called once when a reconfiguration arrives before its apply_at: work that does not need
    # the new groups (the reshard plan, the new stage module) is done then, not in the downtime
    on_command_received: Callable[[Job, m.ReconfigCommand], None] | None = None
    resilience: Resilience | None = None
    progress: ProgressLog | None = None
    dropped_reports: int = 0
    model_json: str = ""  # the model spec as JSON (spec_json), for the hook hello
    # an own loop whose micro-batches per rank were not given: the first step says how many
    # (the plan, and the trace whose header needs it, wait for it)
    _learn_microbatches: bool = False
    _make_trace: Callable[[Plan], TraceCollector | None] | None = None
    _pending: list[m.Command] = field(default_factory=list)
    _last_step_end: float = field(default_factory=time.perf_counter)
    _iteration: int = -1
    _trace_file: IO[str] | None = None
    _closed: bool = False
    _spans: ChunkRecorder = field(default_factory=ChunkRecorder)
    _forward_timer: ForwardTimer | None = None  # init(model=module): the module's forwards are F spans
    _exit_barrier: bool = True

    def __post_init__(self) -> None:
        self._spans.restart(self._last_step_end)
        self.model_json = self.model_json or spec_json(self.model)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        # else: the loop failed; no goodbye (the agent reports the exit). If the script handles
        # the error and ends normally, the exit hook still closes the job.

    def timed(self, kind: str, mb: int | None = None) -> Span:
        """``with job.timed("F"):`` — time this rank's own compute span of the current iteration
        (F, B, W, OPT or DP; micro-batches count up per kind unless ``mb`` is given). The next
        ``step`` reports the spans as its chunks, which lets the detector tell which rank of a
        synchronous DDP step is slow (every rank's step wall time is the same)."""
        return self._spans.timed(kind, mb)

    @property
    def rank(self) -> int:
        return self.boot.rank

    @property
    def world_size(self) -> int:
        return self.boot.world_size

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def iterations(self, total: int, start: int = 0) -> Iterator[int]:
        """The steps to run, in order. Resilient jobs rewind after a rollback and keep an
        excluded (spare) rank waiting here until it is readmitted or the job ends."""
        if self.resilience is not None:
            return self.resilience.iterations(total, start)
        return iter(range(start, total))

    def train_step(self, step: int) -> StepResult | None:
        """The runtime's step ``step``; None when a peer died during it and the job recovered
        (pass the result to ``step`` either way)."""
        if self.resilience is not None:
            return self.resilience.train_step(step)
        if self.runtime is None:
            raise SpecError("train_step: this job has no runtime (init was given no plan); run your own step")
        return self.runtime.train_step(step)

    def step(
        self, result: StepResult | None = None, *, iteration: int | None = None,
        seqlens: Sequence[Sequence[int]] | None = None,
        chunks: Sequence[tuple[str, int, int, float, float]] = (), time_s: float | None = None,
        loss: Any = None, tokens: int | None = None, microbatches: int | None = None,
    ) -> StepOutcome:
        """Report the iteration that just finished and apply the commands due at this boundary.

        A loop without the runtime reports what it knows: ``seqlens`` (per micro-batch, the
        lengths of the sequences packed in it: ``[[T]] * B`` for a plain (B, T) batch),
        ``loss`` (a float or 0-dim tensor) and ``tokens`` (the step's tokens over all ranks;
        default: this rank's seqlens × world size), which go to progress.jsonl for ``resihp
        report``; ``microbatches`` (default len(seqlens), else 1) is read at the first step
        when ``init`` was not given ``microbatches_per_rank``. ``chunks`` default to the
        spans ``timed`` recorded in this iteration."""
        now = time.perf_counter()
        if self._forward_timer is not None:
            self._forward_timer.flush_backward()
        spans = self._spans.take()
        if result is None and self.resilience is not None:
            return StepOutcome(self._iteration)  # the step failed and was recovered: nothing to report
        if result is None:
            # a loop without the runtime: the step is the time since the previous boundary;
            # a throttle stretches the whole step (the hooks do not see its compute chunks)
            it = self._iteration + 1 if iteration is None else iteration
            took = (now - self._last_step_end) if time_s is None else time_s
            timer = self._forward_timer
            if timer is not None and timer.stretched:
                timer.stretched = False  # the throttle stretched this rank's F and B spans themselves
            else:
                took += self.throttle.stall_for(took)
            wall_start = time.time() - took
            seen = self._forward_timer.take_seqlens() if self._forward_timer is not None else ()
            lens = tuple(tuple(int(n) for n in s) for s in (seqlens or seen))
            parts = tuple(chunks) or spans
            forwards = sum(1 for c in parts if c[0] == "F")
            if not lens and tokens and forwards:
                # no batch shape seen: the step's tokens, spread evenly over this rank's forwards
                lens = ((max(1, int(tokens) // (self.world_size * forwards)),),) * forwards
            if self._learn_microbatches:
                self._learn(microbatches or len(lens) or forwards or 1)
        else:
            it, took, wall_start, lens, parts = (
                result.iteration, result.time_s, result.wall_start_s, result.seqlens, tuple(result.chunks)
            )
        self._iteration = it
        start_rel = wall_start - self.boot.job_start_s
        # chunk times from this rank's own iteration start (the joiner aligns ranks by start_s)
        timings = tuple(ChunkTiming(self.rank, k, mb, c, max(0.0, s), max(0.0, e)) for k, mb, c, s, e in parts)
        if not self.transport.report(it, took, wall_start, lens, timings, self.epoch):
            self.dropped_reports += 1
        if self.trace is not None:
            replica = self.plan.position(self.rank).replica if self.plan.has_rank(self.rank) else -1
            self.trace.record(RankIteration(self.rank, it, replica, start_rel, took, lens, parts))
        if self.progress is not None and self.rank == loss_rank(self.plan):
            if result is not None and result.loss is not None:
                self.progress.write("step", step=it, loss=result.loss, tokens=result.global_tokens,
                                    step_s=round(took, 6), epoch=self.epoch, plan=self.plan.describe())
            elif result is None and loss is not None:
                count = tokens if tokens is not None else sum(map(sum, lens)) * self.world_size
                self.progress.write("step", step=it, loss=float(loss), tokens=int(count), step_s=round(took, 6),
                                    epoch=self.epoch, plan=self.plan.describe())
        outcome = self._apply_commands(it)
        self._last_step_end = time.perf_counter()
        self._spans.restart(self._last_step_end)
        return outcome

    def _learn(self, per_rank: int) -> None:
        """The first step of an own loop says how many micro-batches a rank runs per step."""
        if per_rank < 1:
            raise SpecError(f"job.step: microbatches must be >= 1, got {per_rank}")
        self._learn_microbatches = False
        self.plan = Plan.uniform(1, 1, self.world_size, self.model.num_layers, self.world_size * per_rank)
        if self._make_trace is not None:
            self.trace = self._make_trace(self.plan)
            self._make_trace = None

    def _apply_commands(self, iteration: int, force: bool = False) -> StepOutcome:
        """Apply the commands due after ``iteration`` (all of them with ``force``: an idle spare)."""
        arrived = self.transport.poll_commands()
        self._pending.extend(arrived)
        next_it = iteration + 1
        if self.on_command_received is not None and not force:
            for cmd in arrived:
                # (a resilient member never applies a command at the boundary it arrived: see agreement.py)
                if isinstance(cmd, m.ReconfigCommand) and cmd.epoch > self.epoch and m.command_targets(cmd, self.rank) \
                        and (cmd.apply_at > next_it or self.resilience is not None):
                    self.on_command_received(self, cmd)

        # a resilient member applies planned switches and drains where every member does
        members = self.resilience if not force and self.runtime is not None else None
        agreed = members.agreed_at(iteration) if members is not None else None

        def is_due(c: m.Command) -> bool:
            # a plan already in force (applied by a fail-stop recovery) only needs its acknowledgement
            if force or (isinstance(c, m.ReconfigCommand) and c.epoch <= self.epoch):
                return True
            if members is not None and is_agreed_command(c):
                return agreed_due(c, next_it, agreed)
            return c.apply_at <= next_it

        due = [c for c in self._pending if is_due(c)]
        self._pending = [c for c in self._pending if not is_due(c)]
        applied: list[str] = []
        stop = False
        for cmd in sorted(due, key=lambda c: c.seq):
            kind = m.command_kind(cmd)
            if not m.command_targets(cmd, self.rank) or isinstance(cmd, m.NoticeCommand):
                continue  # a notice is information (the agent client prints it): never applied nor acknowledged
            try:
                if isinstance(cmd, m.ThrottleCommand):
                    self._throttle_to(cmd.factor, next_it, cmd.reason or "injected")
                elif isinstance(cmd, m.DrainCommand):
                    stop = True
                elif self.on_reconfigure is not None:
                    if self.on_reconfigure(self, cmd) is False:
                        continue  # the handler acknowledges it later (a fail-stop plan: the recovery does)
                else:
                    raise RuntimeError(
                        f"live reconfiguration is not installed in this runtime; staying on plan epoch {self.epoch}"
                    )
            except Exception as exc:  # the command failed here; say why in the acknowledgement
                log.error("resihp: rank %d could not apply %s command %d: %s", self.rank, kind, cmd.seq, exc)
                self.transport.ack(cmd, next_it, ok=False, error=str(exc))
                continue
            self.transport.ack(cmd, next_it)
            applied.append(kind)
        if members is not None and not stop:
            members.post_round(iteration, self._pending)
        return StepOutcome(iteration, tuple(applied), stop)

    def _throttle_to(self, factor: float, iteration: int, why: str) -> None:
        """Slow this rank's compute to 1/``factor`` from ``iteration`` (fault injection); the
        log line is what bench/real_runs.py reads the throttle's first iteration from."""
        self.throttle.set_factor(factor)
        log.warning("resihp: rank %d compute throttled to 1/%.2f speed from iteration %d (%s)", self.rank, factor,
                    iteration, why)

    def close(self) -> None:
        """Flush the trace (collective over all ranks), say goodbye to the agent, leave the world.
        Idempotent; runs by itself at a normal interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self._forward_timer is not None:
            self._forward_timer.remove()
        if self._learn_microbatches:  # no step ran: the trace still needs its header
            self._learn(1)
        if self.trace is not None:
            self.trace.close()
        if self._trace_file is not None:
            self._trace_file.close()
        if self.progress is not None and self.plan.has_rank(self.rank) and self.rank == loss_rank(self.plan):
            self.progress.write("end", step=self._iteration, epoch=self.epoch, plan=self.plan.describe())
        self.transport.close()
        if self.resilience is not None and self.resilience.agreement is not None:
            self.resilience.agreement.close()
        # no daemon thread may be inside torch when the interpreter exits (it would abort the
        # process): let the old epochs' groups finish closing
        if not wait_retired(10.0):
            log.warning("resihp: rank %d: old process groups still closing after 10 s", self.rank)
        # after a failure the MPI world is broken: no closing barrier (the store is external)
        self.boot.close(barrier=self.resilience is None and self._exit_barrier)

    def _close_at_exit(self) -> None:
        """The interpreter is ending: close, unless it ends on an uncaught exception (then the
        rank failed, and its agent reports the exit as one; no collective may wait for it)."""
        if self._closed:
            return
        failure = EXIT_STATUS.failure()
        if failure is not None:
            why, code = failure
            resilient = self.resilience is not None
            log.warning("resihp: rank %d ends on %s; leaving without a goodbye (a failed rank%s)", self.rank, why,
                        ", ended by SIGKILL so that the survivors' MPI sees it fail" if resilient else "")
            if self.world_size > 1:
                # MPI's own exit (MPI_Finalize) waits for peers that may be blocked in a collective
                # with this rank: a failed rank leaves at once, so that its agent and its peers see it
                leave_now(code, as_failed_process=resilient)
            return
        try:
            # no closing barrier at exit where the store is outside the trainers: a peer that
            # died meanwhile must not hang this rank's exit
            self._exit_barrier = not os.environ.get(STORE_ENV, "").strip()
            self.close()
        except Exception as exc:  # the world may be half gone at exit; never turn a clean exit into a crash
            log.warning("resihp: rank %d: closing at exit failed: %s", self.rank, exc)


def init(
    model: Any, plan: Plan | AutoLayout | None = None, *, layout: Any = None, config: TrainConfig | None = None,
    agent: str | None = None, transport: Transport | None = None, trace: str | None = None, trace_every: int = 20,
    job: str = "", backend: str | None = None, microbatches_per_rank: int | None = None, timeout_s: float = 120.0,
    comm: Any = None, resilient: bool | None = None, failure_timeout_s: float = 6.0, progress: str | None = None,
    checkpoint_dir: str | None = None, probe_every_s: float | None = None, optimizer: Any = None,
) -> Job:
    """Start-up: MPI bootstrap into torch.distributed, connect to the node's agent, and — given a
    plan — build the groups and place the model and AdamW. Without a plan the loop keeps its own
    model (e.g. DDP) and the job only reports (as a DP layout of one micro-batch share per rank).

    model: a ModelSpec, a preset name, a dict of ModelSpec fields, a JSON/YAML file of one, or the
    ``nn.Module`` itself (its shape read from ``config``: nanoGPT's or Hugging Face's names); under
    ``resihp launch --model X`` it must match X (SpecError naming both). The process group: if the
    script already called ``init_process_group`` (torchrun style, from the env:// variables
    ``resihp launch`` sets), it is reused, else MPI bootstraps one. microbatches_per_rank: an own
    loop's micro-batches per rank per step (default: learned from the first ``step``). agent: the agent's address (default: from the environment
    ``resihp launch`` sets; none reachable → one warning, training goes on). trace: a path for
    the trace file (default: $RESIHP_TRACE, else $RESIHP_RUN_DIR/trace.jsonl under ``resihp
    launch``; none = no trace), written by global rank 0. job: the job's name; $RESIHP_JOB (set by
    ``resihp launch``, and the name the node agent checks) takes precedence. probe_every_s: how
    often a resilient job's idle spare times and reports a compute probe (default
    $RESIHP_PROBE_EVERY_S, else 30 s); every rank of a resilient job probes once here.

    ``plan=AutoLayout(microbatches=M)`` (or no plan under ``resihp launch --layout auto``): the
    layout is chosen by timing the healthy candidates on this job's ranks before training
    (trainer_hooks/runtime/autolayout.py); under the launcher its profile already chose it.

    With a plan, ``model`` may be the user's own model (an ``nn.Module``, or a function that builds
    one) with ``layout`` a ``LayoutSpec`` saying how it is laid out (a Hugging Face model needs
    none: it declares its plans); resihp then cuts, shards and reshards that model
    (docs/your-model.md). A spec or preset name trains resihp's own GPT of that shape.
    ``optimizer``: a function from the parameters to a ``torch.optim`` optimizer (default AdamW
    from the config); its per-parameter tensors and step count move with every reshard.
    """
    cfg = config or TrainConfig()
    DEATHS.clear()  # deaths heard by an earlier job of this process are not this job's
    auto = requested_layout(plan)
    recipe = None
    if plan is not None or auto is not None:
        from resihp.trainer_hooks.usermodel.recipe import recipe_for

        # an auto layout's TP sizes are checked per candidate (autolayout.candidates)
        recipe = recipe_for(model, layout, plan if isinstance(plan, Plan) else Plan.uniform(1, 1, 1, 1, 1), cfg)
    spec = recipe.spec if recipe is not None else resolve_model(model)
    check_launch_model(spec)
    probe_every = probe_interval(probe_every_s)
    external_store = bool(os.environ.get(STORE_ENV, "").strip())
    planned = plan is not None or auto is not None
    resilient = (planned and external_store) if resilient is None else resilient
    if resilient and (not planned or not external_store):
        raise SpecError(f"init: a resilient job needs a plan and a store outside the trainers (set {STORE_ENV}=host:port, "
                        "as `resihp launch` does)")
    boot = Bootstrap(comm=comm, backend=backend, timeout_s=failure_timeout_s if resilient else timeout_s)
    info = boot.init_epoch(plan.epoch if isinstance(plan, Plan) else 0)
    if auto is not None:
        plan = _auto_plan(boot, spec, cfg, auto.for_world(boot.world_size), info.device, recipe, optimizer)
    assert plan is None or isinstance(plan, Plan)
    plan_given = plan
    throttle = Throttle()
    env_throttle = parse_throttle_env(os.environ.get(THROTTLE_ENV, ""), boot.rank)
    runtime = None
    if plan is not None:
        missing = sorted(set(range(boot.world_size)) - set(plan.ranks()) - set(plan.spares))
        if max(plan.ranks()) >= boot.world_size or missing:
            raise SpecError(
                f"init: the plan covers ranks {list(plan.ranks())} (spares {list(plan.spares)}) but the world has "
                f"{boot.world_size} ranks; every rank must be in the plan or a spare"
            )
        # a resilient job's sub-groups time out quickly too: a silent peer is a failed peer
        with group_timeout(failure_timeout_s if resilient else None):
            runtime = Runtime(spec, plan, boot.rank, cfg, device=info.device, throttle=throttle, epoch=plan.epoch,
                              recipe=recipe, optimizer=optimizer)
    else:
        plan = Plan.uniform(1, 1, boot.world_size, spec.num_layers, boot.world_size * (microbatches_per_rank or 1))
    job = os.environ.get("RESIHP_JOB") or job  # under `resihp launch` the agent knows the job by its name
    # the hello says whether this rank can be reshaped (a resilient job) and which model it trains:
    # a loop that keeps its own model is observed, never reshaped (docs/control-plane.md)
    tx = transport or connect(boot.rank, boot.local_rank, job, agent, reshapes=bool(resilient),
                              model_json=spec_json(spec))
    # under `resihp launch` the coordinator writes <run-dir>/trace.jsonl from every rank's reports
    path = trace if trace is not None else os.environ.get(TRACE_ENV) or None
    out = None
    if path and boot.rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "w", encoding="utf-8")

    def make_trace(for_plan: Plan) -> TraceCollector | None:
        if not path:
            return None
        header = None if out is None else make_header(
            spec, for_plan, boot.nodes, job, cfg.budget,
            {"source": "resihp.trainer_hooks", "backend": boot.backend, "seed": cfg.seed})
        return TraceCollector(boot.comm, boot.rank, 0, for_plan, every=trace_every, out=out, header=header)

    learn = plan_given is None and microbatches_per_rank is None
    progress_path = progress or os.environ.get(PROGRESS_ENV) or (
        str(Path(os.environ["RESIHP_RUN_DIR"]) / "progress.jsonl") if os.environ.get("RESIHP_RUN_DIR") else None)
    job_obj = Job(boot=boot, model=spec, plan=plan, config=cfg, transport=tx, throttle=throttle, runtime=runtime,
                  trace=None if learn else make_trace(plan), _trace_file=out, _learn_microbatches=learn,
                  _make_trace=make_trace if learn else None,
                  progress=ProgressLog(progress_path) if progress_path else None)
    if plan_given is None and callable(getattr(model, "register_forward_pre_hook", None)):
        job_obj._forward_timer = ForwardTimer(job_obj._spans, model, throttle)  # pyright: ignore[reportPrivateUsage]
    EXIT_STATUS.install()
    atexit.register(job_obj._close_at_exit)  # pyright: ignore[reportPrivateUsage]  # its own exit hook
    if job_obj.progress is not None and boot.rank == 0:
        job_obj.progress.write("start", plan=plan.describe(), world=boot.world_size, model=spec.name,
                               tokens_per_microbatch=cfg.budget)
    if resilient:
        from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
        from resihp.trainer_hooks.reconfig.ulfm import ft_world

        assert runtime is not None
        rc = LiveReconfigurer(spec, plan, boot.rank, cfg, info.store_addr, runtime=runtime, throttle=throttle,
                              timeout_s=failure_timeout_s, group_timeout_s=failure_timeout_s, backend=boot.backend,
                              recipe=recipe, optimizer=optimizer)
        job_obj.resilience = Resilience(job_obj, rc, ft_world(boot.comm, plan.epoch), progress=job_obj.progress,
                                        checkpoint_root=checkpoint_dir or None,
                                        probe=ComputeProbe(info.device, throttle, seed=cfg.seed),
                                        probe_every_s=probe_every)
        if isinstance(tx, NullTransport):
            # no node agent, so no coordinator can send a recovery plan: the survivors' rule
            # decides at once instead of after the wait for one (20 s per failure under plain mpirun)
            job_obj.resilience.plan_wait_s = 0.0
        DEATHS.on_own_death(boot.rank, lambda cmd: fenced_exit(boot.rank, cmd))  # a fenced rank that woke up
        job_obj.on_reconfigure = job_obj.resilience.on_reconfigure
        job_obj.on_command_received = job_obj.resilience.on_command_received
    if env_throttle is not None:
        factor, at, until = env_throttle
        if at <= 0:
            # set here, not through a command boundary: a resilient member's boundary posts an
            # agreement round that every member posts, and no other member has a boundary before
            # the first step (the throttled rank waited for its peers' posts after step 0 and
            # was fenced as hung)
            job_obj._throttle_to(factor, 0, THROTTLE_ENV)
        else:
            job_obj._pending.append(m.ThrottleCommand(plan.epoch, factor, at, reason=f"{THROTTLE_ENV}", seq=-1,
                                                      ranks=(boot.rank,)))
        if until is not None:  # the device is healthy again
            job_obj._pending.append(m.ThrottleCommand(plan.epoch, 1.0, until, reason=f"{THROTTLE_ENV} ends", seq=-1,
                                                      ranks=(boot.rank,)))
    if job_obj.resilience is not None and job_obj.resilience.probe is not None:
        # every rank's start-up probe: the healthy reference the detector judges idle ranks by
        tx.probe(job_obj.resilience.probe.run())
    arm_from_env(boot.rank, lambda: job_obj._iteration + 1)  # $RESIHP_FAULT (trainer_hooks/faults.py)
    # the heap that lives as long as the job (torch, the model) out of every later garbage
    # collection: a full one walked it for ~66 ms, a straggler step (runtime/gc_control.py)
    settle()
    return job_obj


def _auto_plan(boot: Bootstrap, spec: ModelSpec, cfg: TrainConfig, auto: AutoLayout, device: Any,
               recipe: Any, optimizer: Any) -> Plan:
    """The plan an auto layout trains on: the launcher's choice, or this job's own profile.
    In a profile-only start (``resihp launch --layout auto``) rank 0 prints the choice and
    every rank leaves here."""
    only = os.environ.get(LAYOUT_PROFILE_ENV, "").strip() == "1"
    chosen = None if only else planned_by_launcher(spec, boot.world_size, auto.microbatches)
    if chosen is not None:
        chosen.validate_for(spec.num_layers, spec.num_heads)
        return chosen
    if os.environ.get("RESIHP_COORDINATOR") and not only:
        raise SpecError("init: an automatic layout under `resihp launch` is chosen by the launcher; start the job "
                        "with resihp launch --layout auto (its coordinator must know the plan the ranks train on)")

    def build(candidate: Plan) -> Runtime:
        return Runtime(spec, candidate, boot.rank, cfg, device=device, recipe=recipe, optimizer=optimizer)

    fits = recipe.check_plan if recipe is not None else None
    chosen, record = profile_layouts(boot.rank, boot.world_size, boot.nodes, spec, cfg, auto, device, build, fits)
    if boot.rank == 0:
        print(layout_table(record), flush=True)
        if only:
            print(choice_line(record), flush=True)
        elif os.environ.get("RESIHP_RUN_DIR"):
            write_choice(record, Path(os.environ["RESIHP_RUN_DIR"]) / "layout.json")
    if only:
        boot.close()
        raise SystemExit(0)
    return chosen


def step(job: Job, result: StepResult | None = None, **kwargs: Any) -> StepOutcome:
    """Module-level spelling of ``job.step(...)``."""
    return job.step(result, **kwargs)
