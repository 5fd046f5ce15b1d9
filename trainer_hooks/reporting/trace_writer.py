"""Records a real run as a trace (coordinator/model/trace.py, format 1) that ``resihp detect`` replays.

Off the critical path: every rank appends its iteration summaries to a local list; every
``every`` iterations it hands the batch to the writer rank with a non-blocking MPI send
(pickled, mpi4py ``isend``) and only tests the request later. The writer drains whatever
has arrived with ``iprobe`` at its own step boundaries (never waiting), joins the ranks'
records of each iteration and appends complete iterations to the JSON Lines file. At
``close`` the remaining batches are flushed and received. Times are job-relative (the
launch time every rank got at bootstrap) so chunks of different ranks line up.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import IO, Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.coordinator.model.trace import (
    ChunkTiming,
    DeviceInfo,
    IterationRecord,
    PlanChange,
    TraceHeader,
    header_to_dict,
    record_to_dict,
)
from resihp.coordinator.service.tracefmt import dumps, iteration_dict, rows_of

log = logging.getLogger(__name__)
TAG = 7301  # MPI tag of trace batches


@dataclass(frozen=True)
class RankIteration:
    """One rank's summary of one iteration (what travels to the writer)."""

    rank: int
    iteration: int
    replica: int
    wall_start_s: float  # job-relative
    time_s: float
    seqlens: tuple[tuple[int, ...], ...]
    chunks: tuple[tuple[str, int, int, float, float], ...]  # relative to this rank's start


def _replica_seqlens(parts: list[RankIteration], plan: Plan) -> list[tuple[tuple[int, ...], ...]]:
    seqlens: list[tuple[tuple[int, ...], ...]] = []
    for r_idx, rep in enumerate(plan.replicas):
        mine = [p for p in parts if p.replica == r_idx]
        seqlens.append(mine[0].seqlens if mine else tuple(() for _ in range(rep.microbatches)))
    return seqlens


def join_iteration(iteration: int, parts: list[RankIteration], plan: Plan) -> IterationRecord:
    """Join every rank's part of one iteration into one trace record."""
    start = min(p.wall_start_s for p in parts)
    end = max(p.wall_start_s + p.time_s for p in parts)
    parts = sorted(parts, key=lambda p: p.rank)
    chunks = []
    for p in parts:
        shift = p.wall_start_s - start
        for kind, mb, chunk, s, e in p.chunks:
            chunks.append(ChunkTiming(p.rank, kind, mb, chunk, max(0.0, s + shift), max(0.0, e + shift)))
    return IterationRecord(
        iteration=iteration, start_s=max(0.0, start), time_s=end - start, seqlens=tuple(_replica_seqlens(parts, plan)),
        chunks=tuple(chunks), rank_step_s={p.rank: p.time_s for p in parts},
    )


def iteration_line(iteration: int, parts: list[RankIteration], plan: Plan) -> str:
    """The trace line of ``join_iteration(iteration, parts, plan)``, written without building
    the record (the writer rank does this every iteration, on its critical path)."""
    start = min(p.wall_start_s for p in parts)
    end = max(p.wall_start_s + p.time_s for p in parts)
    parts = sorted(parts, key=lambda p: p.rank)
    rows = rows_of((p.rank, p.wall_start_s - start, p.chunks) for p in parts)
    return dumps(iteration_dict(iteration, max(0.0, start), end - start, _replica_seqlens(parts, plan), rows,
                                {p.rank: p.time_s for p in parts}))


@dataclass
class TraceCollector:
    """Per-rank side; the writer rank (``writer``) also owns the file."""

    comm: Any  # mpi4py communicator
    rank: int
    writer: int
    plan: Plan
    every: int = 20
    out: IO[str] | None = None  # only on the writer
    header: TraceHeader | None = None  # only on the writer
    _batch: list[RankIteration] = field(default_factory=list)
    _requests: list[Any] = field(default_factory=list)
    _sent: int = 0  # batches this rank sent to the writer
    _received: int = 0  # batches the writer received
    _pending: dict[int, dict[int, RankIteration]] = field(default_factory=dict)
    _written_through: int = -1
    _plan_changes: list[PlanChange] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rank == self.writer:
            if self.out is None or self.header is None:
                raise ValueError("the trace writer rank needs an output file and a header")
            self.out.write(_dumps(header_to_dict(self.header)) + "\n")
            self.out.flush()

    def record(self, part: RankIteration) -> None:
        self._batch.append(part)
        self._requests = [r for r in self._requests if not r.Test()]
        if len(self._batch) >= self.every:
            self._ship()
        if self.rank == self.writer:
            self._drain(block=False)

    def plan_changed(self, iteration: int, plan: Plan) -> None:
        """The layout changes from ``iteration`` on (written once that iteration is)."""
        self.plan = plan
        if self.rank == self.writer:
            self._plan_changes.append(PlanChange(iteration, plan))

    def _ship(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        if self.rank == self.writer:
            self._accept(batch)
        else:
            self._requests.append(self.comm.isend(batch, dest=self.writer, tag=TAG))
            self._sent += 1

    def _accept(self, batch: list[RankIteration]) -> None:
        for part in batch:
            self._pending.setdefault(part.iteration, {})[part.rank] = part

    def _drain(self, block: bool, expect: int = 0) -> None:
        from mpi4py import MPI

        got = 0
        while True:
            if not block and not self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG):
                break
            if block and got >= expect:
                break
            self._accept(self.comm.recv(source=MPI.ANY_SOURCE, tag=TAG))
            self._received += 1
            got += 1
        self._write_complete()

    def _write_complete(self, final: bool = False) -> None:
        assert self.out is not None
        for it in sorted(self._pending):
            if it <= self._written_through:
                del self._pending[it]
                continue
            parts = self._pending[it]
            ranks = set(self.plan.ranks())
            if not final and not ranks <= set(parts):
                break  # iterations are written in order, once every rank's part is in
            for change in [c for c in self._plan_changes if c.iteration <= it]:
                self.out.write(_dumps(record_to_dict(change)) + "\n")
                self._plan_changes.remove(change)
            self.out.write(iteration_line(it, [p for r, p in parts.items() if r in ranks], self.plan) + "\n")
            self._written_through = it
            del self._pending[it]
        self.out.flush()

    def close(self) -> None:
        """Collective over the communicator: flush every rank's rest to the writer."""
        self._ship()
        counts = self.comm.gather(self._sent, root=self.writer)
        if self.rank == self.writer:
            self._drain(block=True, expect=sum(counts) - self._received)
            self._write_complete(final=True)
        for r in self._requests:
            r.wait()
        self._requests.clear()


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))


def make_header(model: ModelSpec, plan: Plan, nodes: tuple[str, ...], job: str, tokens_per_microbatch: int,
                meta: dict[str, Any]) -> TraceHeader:
    local: dict[str, int] = {}
    devices = []
    for rank, node in enumerate(nodes):
        devices.append(DeviceInfo(rank=rank, node=node, local_rank=local.get(node, 0)))
        local[node] = local.get(node, 0) + 1
    return TraceHeader(model=model, plan=plan, devices=tuple(devices), job=job,
                       tokens_per_microbatch=tokens_per_microbatch, meta=meta)
