"""Packed byte-level training data from the Python standard library's sources.

Documents are the blank-line-separated blocks of the stdlib's ``.py`` files (functions,
classes, docstrings, import groups), so their lengths vary from a few bytes to a few
thousand — relative to a 64–256 token budget that resembles whole files inside an 8K
budget. Tokens are bytes (vocab 256). Documents are packed back to back into micro-batches
of exactly ``tokens_per_microbatch`` (input, target) pairs; a document that does not fit
continues, as a new document, at the start of the next micro-batch (the usual "8K
packing"). Every micro-batch records the lengths of the documents in it (``seqlens``), so
attention can be masked per document and positions restart per document.

Order is a pure function of the seed: micro-batch ``k`` of the stream has sample id ``k``,
and global batch ``s`` is ids ``[s·G, (s+1)·G)`` (G = global micro-batches), handed to
the data-parallel replicas in order by their shares. Any layout therefore trains on the
same samples in the same order, and later issues can prove that none is lost or repeated.

A plan whose replicas carry token shares (``PipelinePlan.tokens``) splits the same global
batch by the *document* instead: each replica takes a contiguous run of the batch's packed
documents that meets its share to within one document, and re-packs them into its plan's
micro-batch count (docsplit.py). Attention is masked per document and positions restart in
each, so a document's token losses do not depend on its neighbours: the step's loss and,
under the token-weighted mean, its gradient are those of any other split, up to the order
of floating-point sums. A model without document masks (``packed=False``) keeps each
stream micro-batch whole: its rows are the documents it keeps apart.
"""
from __future__ import annotations

import functools
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.docsplit import pack, split_runs
from resihp.trainer_hooks.runtime.model import IGNORE

VOCAB = 256


@dataclass(frozen=True)
class Microbatch:
    sample_id: int
    tokens: torch.Tensor  # [T] int64 inputs
    targets: torch.Tensor  # [T] int64 next bytes
    seqlens: tuple[int, ...]  # document lengths, summing to T
    padding: bool = False  # a stand-in that trains nothing (every target IGNORE): see GlobalBatches

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """Every .py file under root (default: the stdlib), excluding installed packages, sorted."""
    return list(_source_files(root or stdlib_root()))


@functools.lru_cache(maxsize=8)
def _source_files(base: Path) -> tuple[Path, ...]:  # walking the stdlib costs ~0.7 s: once per process
    if not base.is_dir():
        raise SpecError(f"data: source directory {str(base)!r} does not exist; pass an existing directory")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files = tuple(sorted(found))
    if not files:
        raise SpecError(f"data: no .py files under {str(base)!r}; point --data at a directory of Python sources")
    return files


def split_documents(text: bytes) -> list[bytes]:
    """Blank-line-separated blocks; each needs >= 2 bytes to give one (input, target) pair."""
    return [block for block in text.replace(b"\r\n", b"\n").split(b"\n\n") if len(block.strip()) >= 2]


class PackedStream:
    """The deterministic stream of packed micro-batches (random access by sample id)."""

    def __init__(self, tokens_per_microbatch: int, seed: int = 0, root: Path | None = None) -> None:
        if tokens_per_microbatch < 1:
            raise SpecError(f"data: tokens_per_microbatch must be >= 1, got {tokens_per_microbatch}")
        self.tokens_per_microbatch = tokens_per_microbatch
        files = source_files(root)
        random.Random(seed).shuffle(files)  # file order is the only randomness
        self._docs = self._documents(files)
        self._cache: list[Microbatch] = []
        self._pending: bytes = b""  # the rest of a document split across micro-batches

    @staticmethod
    def _documents(files: Sequence[Path]) -> Iterator[bytes]:
        while True:  # epochs repeat the same order
            for path in files:
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                yield from split_documents(data)

    def _next_document(self) -> bytes:
        if self._pending:
            doc, self._pending = self._pending, b""
            return doc
        return next(self._docs)

    def _pack_one(self) -> Microbatch:
        budget = self.tokens_per_microbatch
        inputs: list[int] = []
        targets: list[int] = []
        seqlens: list[int] = []
        while len(inputs) < budget:
            doc = self._next_document()
            take = min(len(doc) - 1, budget - len(inputs))  # pairs this micro-batch can hold
            inputs.extend(doc[:take])
            targets.extend(doc[1 : take + 1])
            seqlens.append(take)
            if take < len(doc) - 1:
                self._pending = doc[take:]  # continue the document next time (>= 2 bytes)
        sid = len(self._cache)
        return Microbatch(
            sample_id=sid,
            tokens=torch.tensor(inputs, dtype=torch.int64),
            targets=torch.tensor(targets, dtype=torch.int64),
            seqlens=tuple(seqlens),
        )

    def get(self, sample_id: int) -> Microbatch:
        if sample_id < 0:
            raise IndexError(f"sample id must be >= 0, got {sample_id}")
        while len(self._cache) <= sample_id:
            self._cache.append(self._pack_one())
        return self._cache[sample_id]


@dataclass(frozen=True)
class DocRef:
    """A packed document of a global batch: ``length`` tokens from offset ``start`` of stream
    micro-batch ``sample``."""

    sample: int
    start: int
    length: int


@dataclass(frozen=True)
class ReplicaBatch:
    step: int
    replica: int
    microbatches: tuple[Microbatch, ...]
    global_tokens: int  # tokens of the whole global batch (the loss normaliser)
    documents: tuple[DocRef, ...] = ()  # a token share's documents (empty: whole micro-batches)

    @property
    def sample_ids(self) -> tuple[int, ...]:
        """The stream micro-batches this replica trains (for a token share: those its
        documents come from; a stream micro-batch may then be split between two replicas)."""
        if self.documents:
            return tuple(sorted({d.sample for d in self.documents}))
        return tuple(mb.sample_id for mb in self.microbatches)

    @property
    def seqlens(self) -> tuple[tuple[int, ...], ...]:
        return tuple(mb.seqlens for mb in self.microbatches)

    @property
    def tokens(self) -> int:
        """Tokens this replica trains (padding micro-batches train none)."""
        return sum(mb.num_tokens for mb in self.microbatches if not mb.padding)


class GlobalBatches:
    """Splits global batch ``step`` among the replicas of a plan by their shares.

    ``max_microbatch_tokens``: the largest micro-batch a token share may pack (the model's
    position table; 0 = the stream's micro-batch). ``packed``: the model masks attention per
    document (False: a stream micro-batch is one sequence and is never re-packed).

    A replica whose documents are fewer than its plan's micro-batch count (a step of long
    documents: a batch holds as few as one per stream micro-batch, and a token plan may run
    more micro-batches in all than the batch has) fills the count with one-token padding
    micro-batches whose target is IGNORE: they add exactly zero to the loss and to every
    gradient, and the replica runs the count its plan says, which the coordinator reads from
    its reports (another count is a layout mismatch there, and ends the job's judging).
    """

    def __init__(self, stream: PackedStream, global_microbatches: int, max_microbatch_tokens: int = 0,
                 packed: bool = True) -> None:
        if global_microbatches < 1:
            raise SpecError(f"data: global_microbatches must be >= 1, got {global_microbatches}")
        self.stream = stream
        self.global_microbatches = global_microbatches
        self.cap = max(max_microbatch_tokens, stream.tokens_per_microbatch)  # a stream micro-batch always fits
        self.packed = packed

    def sample_ids(self, step: int) -> range:
        g = self.global_microbatches
        return range(step * g, (step + 1) * g)

    def global_tokens(self, step: int) -> int:
        return sum(self.stream.get(i).num_tokens for i in self.sample_ids(step))

    def documents(self, step: int) -> tuple[DocRef, ...]:
        """The documents of global batch ``step`` in stream order (the plan plays no part);
        a model without document masks has one per stream micro-batch."""
        out: list[DocRef] = []
        for sid in self.sample_ids(step):
            mb = self.stream.get(sid)
            lens = mb.seqlens if self.packed else (mb.num_tokens,)
            start = 0
            for n in lens:
                out.append(DocRef(sid, start, n))
                start += n
        return tuple(out)

    def for_replica(self, step: int, plan: Plan, replica: int) -> ReplicaBatch:
        if plan.document_shares:
            return self._by_documents(step, plan, replica)
        if plan.global_microbatches != self.global_microbatches:
            raise SpecError(
                f"data: the plan's shares sum to {plan.global_microbatches} micro-batches but the global batch has "
                f"{self.global_microbatches}; shares must add up to the global batch"
            )
        offset = sum(rep.microbatches for rep in plan.replicas[:replica])
        ids = self.sample_ids(step)[offset : offset + plan.replicas[replica].microbatches]
        return ReplicaBatch(step, replica, tuple(self.stream.get(i) for i in ids), self.global_tokens(step))

    def _by_documents(self, step: int, plan: Plan, replica: int) -> ReplicaBatch:
        b = self.stream.tokens_per_microbatch
        want = self.global_microbatches * b
        shares = [rep.share_tokens(b) for rep in plan.replicas]
        if sum(shares) != want:
            raise SpecError(f"data: the plan's token shares sum to {sum(shares)} but the global batch has {want} "
                            f"tokens ({self.global_microbatches} micro-batches of {b}); shares must add up to it")
        docs = self.documents(step)
        mine = [docs[i] for i in split_runs([d.length for d in docs], shares)[replica]]
        count = plan.replicas[replica].microbatches
        if self.packed:
            groups = pack([d.length for d in mine], count, self.cap)
            mbs = tuple(self._microbatch([mine[i] for i in g]) for g in groups)
        else:  # whole rows: the split is by the stream micro-batch
            mbs = tuple(self.stream.get(d.sample) for d in mine)
        pad = self._padding(docs[0]) if len(mbs) < count else None
        mbs += tuple(pad for _ in range(count - len(mbs)) if pad is not None)
        return ReplicaBatch(step, replica, mbs, self.global_tokens(step), tuple(mine))

    def _padding(self, doc: DocRef) -> Microbatch:
        """One token of the step's first document with an IGNORE target: it trains nothing."""
        src = self.stream.get(doc.sample)
        return Microbatch(sample_id=doc.sample, tokens=src.tokens[doc.start : doc.start + 1].clone(),
                          targets=torch.full((1,), IGNORE, dtype=torch.int64), seqlens=(1,), padding=True)

    def _microbatch(self, docs: Sequence[DocRef]) -> Microbatch:
        """One micro-batch of whole documents, cut out of their stream micro-batches (its
        sample id is its first document's)."""
        parts = [(self.stream.get(d.sample), d) for d in docs]
        return Microbatch(
            sample_id=docs[0].sample,
            tokens=torch.cat([mb.tokens[d.start : d.start + d.length] for mb, d in parts]),
            targets=torch.cat([mb.targets[d.start : d.start + d.length] for mb, d in parts]),
            seqlens=tuple(d.length for d in docs),
        )

    def all_seqlens(self, step: int, plan: Plan) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return tuple(self.for_replica(step, plan, r).seqlens for r in range(plan.dp))
