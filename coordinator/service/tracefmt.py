"""Trace lines of iteration records, with less Python per chunk.

``json.dumps(record_to_dict(rec), separators=(",", ":"))`` calls a method per chunk and
copies every micro-batch's lengths before the encoder runs; the coordinator's trace does
it every iteration, and the trainer's writer rank too (there after building a
``ChunkTiming`` per chunk only to take it apart again). ``iteration_dict`` builds the same
object from plain rows — the same keys in the same order, times as ``round(x, 9)`` — so
the text is identical (the tests compare both). Pure: no grpc, no torch.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from resihp.coordinator.model.trace import IterationRecord, Record, record_to_dict


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def iteration_dict(iteration: int, start_s: float, time_s: float, seqlens: Sequence[Sequence[Sequence[int]]],
                   rows: list[list[Any]], rank_step_s: Mapping[int, float]) -> dict[str, Any]:
    """``record_to_dict`` of an iteration record; ``rows``: [rank, kind, microbatch, chunk,
    round(start_s, 9), round(end_s, 9)] per chunk (tuples of ints encode as JSON lists)."""
    out: dict[str, Any] = {"type": "iteration", "iteration": iteration, "start_s": round(start_s, 9),
                           "time_s": round(time_s, 9), "seqlens": seqlens}
    if rows:
        out["chunks"] = rows
    if rank_step_s:
        out["rank_step_s"] = {str(k): round(v, 9) for k, v in sorted(rank_step_s.items())}
    return out


def record_line(rec: Record) -> str:
    """``json.dumps(record_to_dict(rec), separators=(",", ":"))``, cheaper for iteration records."""
    if isinstance(rec, IterationRecord):
        r9 = round
        rows = [[c.rank, c.kind, c.microbatch, c.chunk, r9(c.start_s, 9), r9(c.end_s, 9)] for c in rec.chunks]
        return dumps(iteration_dict(rec.iteration, rec.start_s, rec.time_s, rec.seqlens, rows, rec.rank_step_s))
    return dumps(record_to_dict(rec))


def rows_of(parts: Iterable[tuple[int, float, Sequence[tuple[str, int, int, float, float]]]]) -> list[list[Any]]:
    """Chunk rows of ranks' parts: (rank, shift, chunks) with chunk times relative to the rank's
    own start; shifted onto the iteration's start and clamped at 0, as the trace writer joins them."""
    r9 = round
    rows: list[list[Any]] = []
    for rank, shift, chunks in parts:
        # x if x > 0.0 else 0.0 is max(0.0, x) (NaN and -0.0 give 0.0 both ways), without a call
        rows += [[rank, k, mb, c, r9(s + shift, 9) if s + shift > 0.0 else 0.0,
                  r9(e + shift, 9) if e + shift > 0.0 else 0.0] for k, mb, c, s, e in chunks]
    return rows
