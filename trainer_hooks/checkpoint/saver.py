"""Asynchronous full-state checkpoints that load into any plan (docs/checkpoint.md).

Saving (``AsyncCheckpointer``, one per rank, no communication): at a save step every rank
that writes (``checkpoint.format.writer_assignment``) clones its slices of the parameters
and AdamW moments — the only synchronous cost — and a background thread writes them to
``ROOT/step-N.tmp-RUN~PLAN/``. The committing rank's thread then waits (polling, with a
deadline) for every writer's index, writes ``meta.json`` and ``COMPLETE``, renames the
directory to ``ROOT/step-N`` and prunes old checkpoints. A crash anywhere before the rename
leaves no ``step-N`` directory, so readers only ever see whole checkpoints.

Loading is layout-free: ``load_into`` gives a rank of ANY plan (other TP/PP/DP, another
world size) its slices, cut from the stored pieces, and AdamW's step count; training
resumes at ``step + 1`` and, the data stream being a pure function of the step
(trainer_hooks/runtime/data.py), sees the samples the interrupted run would have seen.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.checkpoint.format import (
    CheckpointError,
    Piece,
    Reader,
    bounds_of,
    build_meta,
    check_model,
    commit,
    committer,
    latest_checkpoint,
    list_checkpoints,
    load_full,
    prune,
    read_meta,
    read_rank_index,
    step_dir_name,
    tmp_dir_name,
    write_rank_file,
    writer_assignment,
)
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, ReconfigReport, load_shards, optimizer_steps
from resihp.trainer_hooks.reconfig.transfer import Shards
from resihp.trainer_hooks.runtime.layout import ModelLayout, TensorSpec, gpt_tensor_specs, tensors_of_rank
from resihp.trainer_hooks.runtime.optim import ADAMW_STATES, holds_all
from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

__all__ = [
    "AsyncCheckpointer", "CheckpointError", "SaveRecord", "latest_checkpoint", "list_checkpoints", "load_full",
    "load_into", "read_meta", "restore_live", "shards_for",
]

log = logging.getLogger(__name__)


def default_run_id() -> str:
    """An id every rank of one launch shares and the next launch does not: Open MPI's PMIx
    namespace when run under mpirun, else "solo". Pass your own (e.g. Bootstrap.job_start_s)
    when launching otherwise."""
    return os.environ.get("PMIX_NAMESPACE") or os.environ.get("OMPI_MCA_ess_base_jobid") or "solo"


@dataclass
class SaveRecord:
    """One save on this rank (seconds on this rank's clock)."""

    step: int
    snapshot_s: float = 0.0  # synchronous: cloning this rank's slices
    wait_s: float = 0.0  # synchronous: waiting for this rank's previous save to finish writing
    write_s: float = 0.0  # background: serialise, checksum, write, fsync
    commit_wait_s: float = 0.0  # background, committer only: waiting for the other writers
    nbytes: int = 0
    pieces: int = 0
    committed: Path | None = None  # committer only, once renamed into place
    error: str = ""
    # the save was given up, not failed: the job re-planned before every writer of the old
    # plan wrote (a writer died) and saves the step again under the new plan
    abandoned: str = ""
    written: threading.Event = field(default_factory=threading.Event, repr=False)  # this rank's file is on disk
    done: threading.Event = field(default_factory=threading.Event, repr=False)  # ... and committed (committer)


@dataclass
class _Job:
    record: SaveRecord
    plan: Plan
    adam_step: float
    states: tuple[str, ...]
    pieces: list[tuple[str, str, tuple[tuple[int, int], ...], torch.Tensor]]
    writers: tuple[int, ...]
    data: dict[str, Any]


class _Abandoned(Exception):
    """A save whose plan the job has replaced: given up without an error."""


class AsyncCheckpointer:
    """Saves this rank's share of the full training state every ``every`` steps.

    ``rank``: this process's rank as the plans passed to ``maybe_save`` number it (logical
    ranks). ``run_id``: shared by every rank of one launch, different between launches
    (see ``default_run_id``). ``commit_timeout_s``: how long the committer waits for the
    other writers before giving the save up (a peer that died mid-save). ``clock``: for the
    timings; ``wall``: the commit timestamp in meta.json.
    """

    def __init__(self, root: Path | str, rank: int, spec: ModelSpec, config: TrainConfig, *, keep: int = 2,
                 run_id: str | None = None, commit_timeout_s: float = 300.0, poll_s: float = 0.02,
                 fsync: bool = True, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time, layout: ModelLayout | None = None) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint: keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.rank = rank
        self.spec = spec
        self.config = config
        self.keep = keep
        self.run_id = run_id if run_id is not None else default_run_id()
        self.commit_timeout_s = commit_timeout_s
        self.poll_s = poll_s
        self.fsync = fsync
        self.clock = clock
        self.wall = wall
        # ``layout``: a user's model's tensors (Runtime.recipe.layout()); None: the runtime's GPT
        self.specs: list[TensorSpec] = layout.tensor_specs() if layout is not None else gpt_tensor_specs(
            spec, config.max_seq_len)
        self.records: list[SaveRecord] = []
        self.errors: list[str] = []
        self._latest_plan: Plan | None = None  # the plan of the latest save: older plans' commits are given up
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._commits: queue.Queue[_Job | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, name=f"checkpoint-write-r{rank}", daemon=True),
                         threading.Thread(target=self._committer, name=f"checkpoint-commit-r{rank}", daemon=True)]
        for t in self._threads:
            t.start()

    # --- the training thread --------------------------------------------------------------
    def maybe_save(self, step: int, runtime: Runtime | None, plan: Plan, *, every: int) -> SaveRecord | None:
        """Save after ``step`` when ``(step + 1) % every == 0`` (call after the step's update)."""
        if every < 1:
            raise ValueError(f"checkpoint: every must be >= 1, got {every}")
        if (step + 1) % every:
            return None
        return self.save(step, runtime, plan)

    def save(self, step: int, runtime: Runtime | None, plan: Plan) -> SaveRecord:
        """Snapshot this rank's slices of the state after ``step`` and queue them for writing.

        At most one snapshot per rank is in flight: a save due while this rank's previous file
        is still being written waits for it (``SaveRecord.wait_s``) rather than pile up
        copies. It never waits for other ranks: commits run on their own thread."""
        rec = SaveRecord(step)
        self._latest_plan = plan
        t0 = self.clock()
        if self.records and not self.records[-1].written.is_set():
            self.records[-1].written.wait()
        t1 = self.clock()
        assign = writer_assignment(plan, self.specs)
        mine = assign.get(self.rank, [])
        pieces: list[tuple[str, str, tuple[tuple[int, int], ...], torch.Tensor]] = []
        states: tuple[str, ...] = ("param",)
        adam = optimizer_steps(runtime)
        if runtime is not None:
            params = runtime.shards()
            opt = runtime.optimizer_state()
            names = getattr(runtime, "opt_states", ADAMW_STATES).tensors  # the optimizer's per-parameter tensors
            have_opt = all(holds_all(opt[n], names) for n in params)
            states = ("param", *names) if have_opt else ("param",)
            with torch.no_grad():
                for tspec, idx in mine:
                    b = bounds_of(idx)
                    want = tuple(hi - lo for lo, hi in b)
                    if tspec.name not in params or tuple(params[tspec.name].shape) != want:
                        raise CheckpointError(
                            f"checkpoint: rank {self.rank} should hold {tspec.name}{list(b)} (shape {want}) under the "
                            "plan, but its runtime does not; pass the plan (logical ranks) the runtime was built for")
                    # clone on the tensor's device (a device-to-device copy on GPUs); the writer
                    # thread moves it to host memory
                    pieces.append(("param", tspec.name, b, params[tspec.name].detach().clone()))
                    if have_opt:
                        for s in names:
                            pieces.append((s, tspec.name, b, opt[tspec.name][s].detach().clone()))
        elif mine:
            raise CheckpointError(f"checkpoint: rank {self.rank} is a writer under the plan but has no runtime")
        rec.wait_s, rec.snapshot_s = t1 - t0, self.clock() - t1
        batch_mbs = plan.batch_microbatches(self.config.budget)  # token shares: the batch, not their counts
        data = {
            "next_step": step + 1, "global_microbatches": batch_mbs,
            "next_sample_id": (step + 1) * batch_mbs,
            "seed": self.config.seed if self.config.data_seed < 0 else self.config.data_seed,
            "tokens_per_microbatch": self.config.budget, "root": self.config.data_root,
        }
        self.records.append(rec)
        self._queue.put(_Job(rec, plan, adam, states, pieces, tuple(sorted(assign)), data))
        return rec

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every queued save of this rank is written (and, on the committer,
        committed); raise CheckpointError on a failed one or a timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for rec in list(self.records):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not rec.done.wait(left):
                raise CheckpointError(f"checkpoint: the save of step {rec.step} is still being written after "
                                      f"{timeout_s} s")
        if self.errors:
            raise CheckpointError("; ".join(self.errors))

    def close(self, timeout_s: float | None = None) -> None:
        """Finish queued saves, stop the threads; raise CheckpointError if any save failed."""
        try:
            self.wait(timeout_s)
        finally:
            self._stop.set()
            self._queue.put(None)
            for t in self._threads:
                t.join(timeout=timeout_s)

    # --- the background threads -----------------------------------------------------------
    def _fail(self, job: _Job, exc: Exception) -> None:
        msg = f"checkpoint of step {job.record.step} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
        log.error(msg)
        job.record.error = msg
        self.errors.append(msg)

    def _worker(self) -> None:
        """Writes this rank's files, in save order; hands commits to the commit thread."""
        while True:
            job = self._queue.get()
            if job is None:
                self._commits.put(None)
                return
            commits = False
            try:
                commits = self._write(job)
            except Exception as exc:  # noqa: BLE001 - a failed save must not kill training
                self._fail(job, exc)
            finally:
                job.record.written.set()
                if commits:
                    self._commits.put(job)
                else:
                    job.record.done.set()

    def _committer(self) -> None:
        while True:
            job = self._commits.get()
            if job is None:
                return
            try:
                self._commit(job, self.root / tmp_dir_name(job.record.step, self.run_id, job.plan))
            except _Abandoned as why:
                job.record.abandoned = str(why)
                log.warning("checkpoint of step %d given up on rank %d: %s", job.record.step, self.rank, why)
            except Exception as exc:  # noqa: BLE001 - a failed save must not kill training
                self._fail(job, exc)
            finally:
                job.record.done.set()

    def _write(self, job: _Job) -> bool:
        """Write this rank's file; True if this rank then commits the checkpoint."""
        rec = job.record
        t0 = self.clock()
        header = {"run_id": self.run_id, "step": rec.step, "plan": job.plan.to_dict(), "adam_step": job.adam_step,
                  "states": list(job.states)}
        if job.pieces:  # (a rank that writes nothing must not touch the directory: it may be committed already)
            tmp = self.root / tmp_dir_name(rec.step, self.run_id, job.plan)
            tmp.mkdir(parents=True, exist_ok=True)
            host = [(s, n, b, t.to("cpu").numpy()) for s, n, b, t in job.pieces]
            written = write_rank_file(tmp, self.rank, host, header, fsync=self.fsync)
            rec.nbytes, rec.pieces = sum(p.nbytes for p in written), len(written)
        job.pieces = []  # free the snapshot
        rec.write_s = self.clock() - t0
        return self.rank == committer(job.plan)

    def _commit(self, job: _Job, tmp: Path) -> None:
        rec = job.record
        t0 = self.clock()
        deadline = t0 + self.commit_timeout_s
        want = {r: None for r in job.writers}
        indexes: dict[int, dict[str, Any]] = {}
        while True:
            for r in want:
                if r not in indexes:
                    idx = read_rank_index(tmp, r)
                    if idx is not None:
                        if idx.get("run_id") != self.run_id or idx.get("step") != rec.step or \
                                idx.get("plan") != job.plan.to_dict():
                            raise CheckpointError(f"{tmp}/rank {r}: an index from another save (run "
                                                  f"{idx.get('run_id')!r}, step {idx.get('step')!r}); not committing")
                        indexes[r] = idx
            if len(indexes) == len(want):
                break
            if self._latest_plan is not None and self._latest_plan != job.plan:
                missing = sorted(set(want) - set(indexes))
                raise _Abandoned(f"ranks {missing} did not write their files before the job re-planned; a save under "
                                 f"the new plan takes its place (left in {tmp}, removed by a later save)")
            newer = not self._commits.empty()  # a later save is ready to commit: this one is superseded
            if self.clock() > deadline or self._stop.is_set() or newer:
                missing = sorted(set(want) - set(indexes))
                why = "a newer save superseded it" if newer else f"within {self.commit_timeout_s} s"
                raise CheckpointError(f"step {rec.step} not committed: ranks {missing} did not write their files "
                                      f"({why}; left in {tmp}, removed by a later save)")
            self._stop.wait(self.poll_s)  # polling the other writers' index files, with a deadline
        rec.commit_wait_s = self.clock() - t0
        adam = {float(i["adam_step"]) for i in indexes.values()}
        states = {tuple(i["states"]) for i in indexes.values()}
        if len(adam) != 1 or len(states) != 1:
            raise CheckpointError(f"step {rec.step}: writers disagree on AdamW's step {sorted(adam)} or the saved "
                                  f"states {sorted(states)}; not committing")
        files = {f"rank-{r:05d}.bin": [Piece.from_dict(p) for p in i["pieces"]] for r, i in indexes.items()}
        meta = build_meta(
            model=self.spec, max_seq_len=self.config.max_seq_len, plan=job.plan, step=rec.step, adam_step=adam.pop(),
            states=states.pop(), specs=self.specs, files=files, data=job.data,
            train={k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self.config).items()},
            run_id=self.run_id, now=self.wall(),
        )
        final = self.root / step_dir_name(rec.step)
        commit(tmp, final, meta, fsync=self.fsync)
        rec.committed = final
        removed = prune(self.root, self.keep, self.run_id, rec.step)
        log.info("[rank %d] checkpoint of step %d committed at %s (pruned %d)", self.rank, rec.step, final,
                 len(removed))


# --- loading ------------------------------------------------------------------------------

def _check_data(meta: dict[str, Any], config: TrainConfig, global_microbatches: int, where: str) -> None:
    data = meta["data"]
    seed = config.seed if config.data_seed < 0 else config.data_seed
    diff = [f"{k}: checkpoint {data[k]!r} vs job {v!r}" for k, v in
            (("global_microbatches", global_microbatches), ("seed", seed),
             ("tokens_per_microbatch", config.budget), ("root", config.data_root)) if data[k] != v]
    if diff:
        raise CheckpointError(
            f"checkpoint {where}: the job's data stream differs from the saved run's ({'; '.join(diff)}), so a "
            "resumed run would not see the same samples; keep them equal or pass strict_data=False")


def shards_for(path: Path | str, plan: Plan, rank: int, spec: ModelSpec, max_seq_len: int,
               device: torch.device | None = None, layout: ModelLayout | None = None) -> tuple[Shards, float, int]:
    """(this rank's shards under ``plan``, AdamW's step count, the step to resume at)."""
    meta = read_meta(path)
    check_model(meta, spec, max_seq_len, str(path))
    reader = Reader(path, meta)
    shards: Shards = {}
    specs = layout.tensor_specs() if layout is not None else gpt_tensor_specs(spec, max_seq_len)
    for tspec, idx in tensors_of_rank(plan, rank, specs):
        for state in meta["states"]:
            arr = reader.read(state, tspec.name, bounds_of(idx))
            t = torch.from_numpy(arr.copy())  # own, writable memory
            shards.setdefault(state, {})[tspec.name] = t.to(device) if device is not None else t
    return shards, float(meta["adam_step"]), int(meta["resume_step"])


def load_into(runtime: Runtime | None, plan: Plan, rank: int, path: Path | str, *, spec: ModelSpec | None = None,
              config: TrainConfig | None = None, strict_data: bool = True) -> int:
    """Give ``rank`` its slices of the checkpoint under ``plan`` (any layout) and AdamW's
    step count; return the step to resume at. ``runtime`` None (a spare): nothing to load.
    ``plan``/``rank`` number ranks as the caller does (the runtime may hold a renumbered copy)."""
    if runtime is None and (spec is None or config is None):
        return int(read_meta(path)["resume_step"])
    spec = spec or runtime.spec  # type: ignore[union-attr]
    config = config or runtime.config  # type: ignore[union-attr]
    meta = read_meta(path)
    check_model(meta, spec, config.max_seq_len, str(path))
    if strict_data:
        _check_data(meta, config, plan.batch_microbatches(config.budget), str(path))
    if runtime is None:
        return int(meta["resume_step"])
    recipe = runtime.recipe
    shards, adam, resume = shards_for(path, plan, rank, spec, config.max_seq_len, runtime.device,
                                      recipe.layout() if recipe is not None else None)
    have = {n: tuple(p.shape) for n, p in runtime.shards().items()}
    got = {n: tuple(t.shape) for n, t in shards.get("param", {}).items()}
    if have != got:
        raise CheckpointError(f"checkpoint: rank {rank} under the given plan holds {sorted(got)} but its runtime holds "
                              f"{sorted(have)} (or other shapes); pass the plan the runtime was built for")
    load_shards(runtime, shards, adam)
    log.info("[rank %d] loaded %s (step %d, AdamW step %g); resuming at %d", rank, path, meta["step"], adam, resume)
    return resume


def restore_live(rc: LiveReconfigurer, new_plan: Plan, epoch: int, path: Path | str, *,
                 members: Sequence[int] | None = None) -> tuple[ReconfigReport, int]:
    """Switch a running job to ``new_plan`` with its state from a checkpoint (collective).

    For recoveries no live replica can serve (a fail-stop with DP = 1): every rank reads its
    own slices of ``new_plan`` from the checkpoint, and ``rc.apply`` regroups and rebuilds
    with a reshard that is local on every rank. Returns the report and the step to resume at."""
    members = tuple(members) if members is not None else rc.members
    if new_plan.has_rank(rc.rank):
        shards, adam, resume = shards_for(path, new_plan, rc.rank, rc.spec, rc.config.max_seq_len, layout=rc.layout)
    else:
        shards, adam, resume = {}, 0.0, int(read_meta(path)["resume_step"])
    # the checkpoint puts every slice where new_plan wants it: present that as the current layout
    rc.plan = replace(new_plan, epoch=rc.epoch)
    report = rc.apply(new_plan, epoch, old_shards=shards, alive=members, members=members, adam_steps=adam)
    return report, resume

