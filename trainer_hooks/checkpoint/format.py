"""On-disk format of a resihp checkpoint (docs/checkpoint.md). Pure: numpy, json, zlib.

A checkpoint is a directory ``ROOT/step-{N:08d}/``:

- ``rank-{R:05d}.bin``: the slices rank R wrote, raw C-order little-endian arrays back to
  back (no pickle, so loading a checkpoint never runs code);
- ``rank-{R:05d}.json``: R's index: for each piece its state, tensor name, slice bounds,
  dtype, byte offset, byte count and CRC-32; written (atomically) after the ``.bin``;
- ``meta.json``: model spec, plan, step, AdamW step, data position, tensor shapes, and
  every file's pieces (the union of the indexes);
- ``COMPLETE``: the commit marker, written after ``meta.json``; then the directory, built
  as ``step-{N:08d}.tmp-{RUN}~{PLAN}``, is renamed into place. ``PLAN`` (a hash of the plan)
  gives each attempt at a step its own directory: after a rank dies at a save step, the job
  re-plans and saves that step again, and a survivor's index from the first attempt (another
  plan) must not be read as part of the second.

Only directories named ``step-N`` holding ``COMPLETE`` are checkpoints; anything else under
the root is an unfinished save (a crash mid-save leaves one) and is ignored.

Writers are chosen so that every element of every state is written exactly once
(``writer_assignment``): the first data-parallel replica's ranks, and for tensors a TP
group replicates, only TP rank 0.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.runtime.layout import Index, TensorSpec, tensors_of_rank

FORMAT = 1
META = "meta.json"
COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d{8})$")
_TMP_RE = re.compile(r"^step-(\d{8})\.(tmp|old)-(.+?)(?:~[0-9a-f]{8})?$")

Bounds = tuple[tuple[int, int], ...]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model.
    The message names the file and what to do (usually: use an older checkpoint)."""


@dataclass(frozen=True)
class Piece:
    """One slice of one state of one tensor, stored in a rank file."""

    state: str
    name: str
    bounds: Bounds  # [start, stop) per dimension, global coordinates
    dtype: str  # numpy dtype string, e.g. "<f4"
    offset: int  # byte offset in the .bin
    nbytes: int
    crc32: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "name": self.name, "bounds": [list(b) for b in self.bounds],
                "dtype": self.dtype, "offset": self.offset, "nbytes": self.nbytes, "crc32": self.crc32}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Piece:
        return cls(str(d["state"]), str(d["name"]), tuple((int(a), int(b)) for a, b in d["bounds"]),
                   str(d["dtype"]), int(d["offset"]), int(d["nbytes"]), int(d["crc32"]))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int, run_id: str, plan: Plan | None = None) -> str:
    """Where a save of ``step`` is built: one directory per launch and plan (``plan_tag``)."""
    return f"{step_dir_name(step)}.tmp-{safe_run_id(run_id)}" + (f"~{plan_tag(plan)}" if plan is not None else "")


def plan_tag(plan: Plan) -> str:
    """Eight hex digits that tell plans apart (a hash of the plan's JSON)."""
    return f"{zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode()):08x}"


def safe_run_id(run_id: str) -> str:
    """``run_id`` reduced to characters safe in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id) or "run"


def rank_bin(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def rank_index(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def bounds_of(index: Index) -> Bounds:
    return tuple((int(s.start), int(s.stop)) for s in index)


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


# --- who writes what ------------------------------------------------------------------------

def writer_assignment(plan: Plan, specs: Sequence[TensorSpec]) -> dict[int, list[tuple[TensorSpec, Index]]]:
    """rank → the slices it writes, so that the checkpoint holds every element once.

    Replica 0 runs the whole model and its TP groups partition every split tensor; a tensor a
    TP group replicates (``tp_dim`` None) is written by the group's TP rank 0 only, and a weight
    tied between the first and the last stage (``where == "ends"``) by the first stage only."""
    out: dict[int, list[tuple[TensorSpec, Index]]] = {}
    for rank in plan.replicas[0].ranks():
        pos = plan.position(rank)
        mine = [(s, idx) for s, idx in tensors_of_rank(plan, rank, specs)
                if (s.tp_dim is not None or pos.tp_index == 0) and (s.where != "ends" or pos.stage == 0)]
        if mine:
            out[rank] = mine
    return out


def committer(plan: Plan) -> int:
    """The rank that commits a checkpoint: replica 0, stage 0, TP rank 0 (it always writes)."""
    return plan.replicas[0].stages[0][0]


# --- writing --------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Mapping[str, Any], *, fsync: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_rank_file(directory: Path, rank: int, pieces: Iterable[tuple[str, str, Bounds, np.ndarray]],
                    header: Mapping[str, Any], *, fsync: bool = True) -> list[Piece]:
    """Write ``rank``'s ``.bin`` then its index (atomically, last): the index existing means
    the data is complete. ``header`` goes into the index (run id, step, plan, ...)."""
    out: list[Piece] = []
    offset = 0
    with (directory / rank_bin(rank)).open("wb") as fh:
        for state, name, bounds, arr in pieces:
            if tuple(b - a for a, b in bounds) != arr.shape:
                raise CheckpointError(f"{state} of {name}: slice {bounds} does not match the array shape {arr.shape}")
            data = np.ascontiguousarray(arr)
            dt = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
            data = data.astype(dt, copy=False)
            view = data.data.cast("B")
            fh.write(view)
            out.append(Piece(state, name, bounds, data.dtype.str, offset, data.nbytes, crc32(view)))
            offset += data.nbytes
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    write_json_atomic(directory / rank_index(rank),
                      {**header, "rank": rank, "pieces": [p.to_dict() for p in out]}, fsync=fsync)
    return out


def read_rank_index(directory: Path, rank: int) -> dict[str, Any] | None:
    """A rank's index, or None while it is not written yet."""
    path = directory / rank_index(rank)
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data


def build_meta(*, model: ModelSpec, max_seq_len: int, plan: Plan, step: int, adam_step: float,
               states: Sequence[str], specs: Sequence[TensorSpec], files: Mapping[str, Sequence[Piece]],
               data: Mapping[str, Any], train: Mapping[str, Any], run_id: str, now: float) -> dict[str, Any]:
    """The content of ``meta.json``; ``now``: wall-clock seconds of the commit."""
    return {
        "format": FORMAT, "model": model.to_dict(), "max_seq_len": max_seq_len, "plan": plan.to_dict(),
        "step": step, "resume_step": step + 1, "adam_step": adam_step, "states": list(states),
        "tensors": {s.name: list(s.shape) for s in specs}, "data": dict(data), "train": dict(train),
        "run_id": run_id, "committed_unix": now,
        "files": {f: [p.to_dict() for p in ps] for f, ps in sorted(files.items())},
    }


def commit(tmp: Path, final: Path, meta: Mapping[str, Any], *, fsync: bool = True) -> None:
    """Write meta.json and COMPLETE into ``tmp``, then rename it to ``final`` (replacing a
    checkpoint of the same step from an earlier launch)."""
    write_json_atomic(tmp / META, meta, fsync=fsync)
    with (tmp / COMPLETE).open("w") as fh:
        fh.write(f"{meta['step']}\n")
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    if fsync:
        _fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(final.name + f".old-{tmp.name.rsplit('.tmp-', 1)[-1]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if fsync:
        _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- finding and pruning ----------------------------------------------------------------------

def list_checkpoints(root: Path | str) -> list[tuple[int, Path]]:
    """Every COMPLETE checkpoint under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path | str) -> Path | None:
    """The newest COMPLETE checkpoint under ``root`` (None if there is none)."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune(root: Path, keep: int, run_id: str, committed_step: int) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep``, and unfinished saves that can no
    longer complete: another launch's, or this launch's older than ``committed_step``."""
    removed: list[Path] = []
    for _, path in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    me = safe_run_id(run_id)
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if m and (m.group(3) != me or int(m.group(1)) < committed_step or m.group(2) == "old"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# --- reading ----------------------------------------------------------------------------------

def read_meta(path: Path | str) -> dict[str, Any]:
    """``meta.json`` of a COMPLETE checkpoint; CheckpointError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pick one of latest_checkpoint(root)")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (no {COMPLETE} marker: the save did not finish); "
            "use an older checkpoint, e.g. latest_checkpoint(root)")
    try:
        meta: dict[str, Any] = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {META} is unreadable ({exc}); use an older checkpoint") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: format {meta.get('format')!r}, this reader knows {FORMAT}")
    return meta


def check_model(meta: Mapping[str, Any], model: ModelSpec, max_seq_len: int, where: str = "") -> None:
    """Raise CheckpointError naming every field where the checkpoint's model differs."""
    saved = dict(meta["model"])
    want = model.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs job {want[k]!r}" for k in want
            if k != "name" and saved.get(k) != want[k]]
    if meta["max_seq_len"] != max_seq_len:
        diff.append(f"max_seq_len: checkpoint {meta['max_seq_len']!r} vs job {max_seq_len!r}")
    if diff:
        raise CheckpointError(
            f"checkpoint {where or '?'} holds model {saved.get('name')!r}, which does not match this job's "
            f"{model.name!r}: {'; '.join(diff)}. Load it with the model spec it was saved with, or start fresh")


class Reader:
    """Reads pieces of one checkpoint, verifying each piece's CRC-32 once."""

    def __init__(self, path: Path | str, meta: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.meta = dict(meta) if meta is not None else read_meta(self.path)
        self._by_key: dict[tuple[str, str], list[tuple[str, Piece]]] = {}
        for fname, plist in self.meta["files"].items():
            for d in plist:
                p = Piece.from_dict(d)
                self._by_key.setdefault((p.state, p.name), []).append((fname, p))
        self._cache: dict[tuple[str, int], np.ndarray] = {}

    def _load(self, fname: str, piece: Piece) -> np.ndarray:
        key = (fname, piece.offset)
        arr = self._cache.get(key)
        if arr is None:
            where = f"{self.path / fname} ({piece.state} of {piece.name}{list(piece.bounds)})"
            try:
                with (self.path / fname).open("rb") as fh:
                    fh.seek(piece.offset)
                    raw = fh.read(piece.nbytes)
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint file {where} is unreadable ({exc}); use an older checkpoint") from exc
            if len(raw) != piece.nbytes:
                raise CheckpointError(f"checkpoint file {where} is truncated ({len(raw)} of {piece.nbytes} bytes); "
                                      "the checkpoint is corrupt: use an older one")
            if crc32(raw) != piece.crc32:
                raise CheckpointError(f"checkpoint file {where} fails its CRC-32 check: the checkpoint is corrupt; "
                                      "use an older one")
            arr = np.frombuffer(raw, dtype=np.dtype(piece.dtype)).reshape(piece.shape)
            self._cache[key] = arr
        return arr

    def read(self, state: str, name: str, bounds: Bounds) -> np.ndarray:
        """The slice ``bounds`` of ``state`` of tensor ``name``, assembled from stored pieces."""
        stored = self._by_key.get((state, name))
        if not stored:
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no {state} of {name!r}")
        out: np.ndarray | None = None
        covered = 0
        for fname, piece in stored:
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(bounds, piece.bounds))
            if any(lo >= hi for lo, hi in inter):
                continue
            arr = self._load(fname, piece)
            if out is None:
                out = np.empty(tuple(b - a for a, b in bounds), dtype=arr.dtype)
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, piece.bounds))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, bounds))
            out[dst] = arr[src]
            covered += int(np.prod([hi - lo for lo, hi in inter]))
        want = int(np.prod([b - a for a, b in bounds]))
        if out is None or covered != want:
            raise CheckpointError(f"checkpoint {str(self.path)!r} covers {covered} of the {want} elements of {state} "
                                  f"of {name}{list(bounds)}; it is corrupt or was written by another tool")
        return out


def load_full(path: Path | str) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """(meta, state → tensor name → full unsharded array), every piece verified."""
    reader = Reader(path)
    full: dict[str, dict[str, np.ndarray]] = {}
    for state in reader.meta["states"]:
        full[state] = {name: reader.read(state, name, tuple((0, d) for d in shape))
                       for name, shape in reader.meta["tensors"].items()}
    return reader.meta, full
