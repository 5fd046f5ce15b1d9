"""Rank reports in packed wire form: the hot path of hook → agent → coordinator.

A report of a PP2 rank holds ~27 chunk timings and 8 micro-batches. As one protobuf
message per chunk (``RankReport.chunks``) encoding, checking and decoding it cost about
0.15 ms per hop in Python — per rank, per iteration, on the cores the ranks train on. The
packed form (``seqlens_count`` / ``seqlens_flat`` / ``packed_chunks``: parallel arrays that
upb copies in C) makes each hop a handful of list copies. Readers accept either form; the
message-per-chunk form stays for other senders (tests, older hooks) and goes through
``codec``, whose error messages name the bad field the same way.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from resihp.coordinator.model.trace import CHUNK_KINDS, ChunkTiming
from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import (
    MAX_BATCH_ITEMS,
    MAX_CHUNKS,
    MAX_MICROBATCHES,
    MAX_RANK,
    MAX_SEQLEN,
    MAX_SEQS_PER_MICROBATCH,
    ValidationError,
)
from resihp.proto import resihp_pb2 as pb

_INF = math.inf
_KINDS = frozenset(CHUNK_KINDS)


def is_packed(r: pb.RankReport) -> bool:
    return len(r.seqlens_count) > 0 or r.HasField("packed_chunks")


def report_to_wire(r: m.RankReport) -> pb.RankReport:
    """``r`` in packed form; the per-chunk form when a chunk names another rank than the report."""
    chunks = r.chunks
    rank = r.rank
    if any(c.rank != rank for c in chunks):
        return codec.report_to_pb(r)
    out = pb.RankReport(rank=rank, epoch=r.epoch, iteration=r.iteration, start_s=r.start_s, step_s=r.step_s,
                        seqlens_count=[len(s) for s in r.seqlens], seqlens_flat=[x for s in r.seqlens for x in s])
    if chunks:
        out.packed_chunks.kinds = ",".join([c.kind for c in chunks])
        pc = out.packed_chunks
        pc.microbatch.extend([c.microbatch for c in chunks])
        pc.chunk.extend([c.chunk for c in chunks])
        pc.start_s.extend([c.start_s for c in chunks])
        pc.end_s.extend([c.end_s for c in chunks])
    return out


def _fields(r: pb.RankReport, name: str) -> tuple[list[int], list[int], list[str], list[int], list[int],
                                                    list[float], list[float]]:
    """The packed arrays, checked; raises ValidationError naming the field."""
    counts, flat = list(r.seqlens_count), list(r.seqlens_flat)
    if len(r.microbatches) or len(r.chunks):
        raise ValidationError(f"{name}: a packed report must not also carry microbatches/chunks messages")
    if len(counts) > MAX_MICROBATCHES:
        raise ValidationError(f"{name}.seqlens_count holds {len(counts)} micro-batches; the limit is {MAX_MICROBATCHES}")
    if counts and (min(counts) <= 0 or max(counts) > MAX_SEQS_PER_MICROBATCH):
        raise ValidationError(f"{name}.seqlens_count: every micro-batch needs 1..{MAX_SEQS_PER_MICROBATCH} sequence "
                              f"lengths, got {[c for c in counts if c <= 0 or c > MAX_SEQS_PER_MICROBATCH][:3]}")
    if sum(counts) != len(flat):
        raise ValidationError(f"{name}.seqlens_flat holds {len(flat)} lengths but seqlens_count adds up to {sum(counts)}")
    if flat and (min(flat) <= 0 or max(flat) > MAX_SEQLEN):
        raise ValidationError(f"{name}.seqlens_flat must be in 1..{MAX_SEQLEN}, got "
                              f"{[x for x in flat if x <= 0 or x > MAX_SEQLEN][:3]}")
    pc = r.packed_chunks
    kinds = pc.kinds.split(",") if pc.kinds else []
    mbs, cks, starts, ends = list(pc.microbatch), list(pc.chunk), list(pc.start_s), list(pc.end_s)
    n = len(kinds)
    if n > MAX_CHUNKS:
        raise ValidationError(f"{name}.packed_chunks holds {n} chunks; the limit is {MAX_CHUNKS}")
    if not len(mbs) == len(cks) == len(starts) == len(ends) == n:
        raise ValidationError(f"{name}.packed_chunks: kinds, microbatch, chunk, start_s and end_s must have one entry "
                              f"per chunk, got {n}, {len(mbs)}, {len(cks)}, {len(starts)}, {len(ends)}")
    if n:
        if not _KINDS.issuperset(kinds):
            raise ValidationError(f"{name}.packed_chunks.kinds: unknown kind(s) {sorted(set(kinds) - _KINDS)[:3]}; "
                                  f"use {', '.join(CHUNK_KINDS)}")
        if min(mbs) < -1 or min(cks) < 0:
            raise ValidationError(f"{name}.packed_chunks: microbatch must be >= -1 and chunk >= 0")
        if not all([0.0 <= s <= e < _INF for s, e in zip(starts, ends)]):  # NaN fails too
            i = next(i for i, (s, e) in enumerate(zip(starts, ends)) if not 0.0 <= s <= e < _INF)
            raise ValidationError(f"{name}.packed_chunks[{i}]: need finite 0 <= start_s <= end_s, got "
                                  f"{starts[i]!r}, {ends[i]!r}")
    return counts, flat, kinds, mbs, cks, starts, ends


def _check_head(r: pb.RankReport, name: str) -> None:
    rank, it, start_s, step_s = r.rank, r.iteration, r.start_s, r.step_s
    if not (0 <= rank <= MAX_RANK and r.epoch >= 0 and it >= 0 and 0.0 <= start_s < _INF and 0.0 <= step_s < _INF):
        codec.report_from_pb(pb.RankReport(rank=rank, epoch=r.epoch, iteration=it, start_s=start_s, step_s=step_s),
                             name)  # raises with the field's name


def check_report(r: pb.RankReport, name: str = "report") -> tuple[int, int]:
    """Validate one report (either form) without converting it; returns (rank, iteration)."""
    if not is_packed(r):
        return codec.check_report_pb(r, name)
    _check_head(r, name)
    _fields(r, name)
    return r.rank, r.iteration


def report_from_wire(r: pb.RankReport, name: str = "report") -> m.RankReport:
    """Validate and convert one report (either form)."""
    if not is_packed(r):
        return codec.report_from_pb(r, name)
    _check_head(r, name)
    counts, flat, kinds, mbs, cks, starts, ends = _fields(r, name)
    seqlens = []
    at = 0
    for c in counts:
        seqlens.append(tuple(flat[at:at + c]))
        at += c
    rank = r.rank
    chunks = tuple([ChunkTiming(rank, k, mb, ck, s, e) for k, mb, ck, s, e in zip(kinds, mbs, cks, starts, ends)])
    return m.RankReport(rank, r.epoch, r.iteration, r.start_s, r.step_s, tuple(seqlens), chunks)


def agent_batch_from_wire(b: pb.AgentMessage) -> m.AgentBatch:
    """``codec.agent_batch_from_pb`` that also reads packed reports. Consumes ``b``'s reports."""
    if not len(b.reports):
        return codec.agent_batch_from_pb(b)
    total = (len(b.reports) + len(b.acks) + len(b.exits) + len(b.gpus) + len(b.processes) + len(b.joined)
             + len(b.probes))
    if total > MAX_BATCH_ITEMS:
        raise ValidationError(f"agent message carries {total} items; the limit is {MAX_BATCH_ITEMS}")
    reports = tuple([report_from_wire(r, f"reports[{i}]") for i, r in enumerate(b.reports)])
    b.ClearField("reports")  # decoded above; the rest goes through the codec unchanged
    return replace(codec.agent_batch_from_pb(b), reports=reports)


def report_batch(reports: Sequence[m.RankReport], heartbeats: Sequence[Any] = (),
                 probes: Sequence[m.RankProbe] = ()) -> pb.HookReportBatch:
    """A hook's batch of reports (packed), heartbeats and probes, ready for ``ReportStream``."""
    return pb.HookReportBatch(reports=[report_to_wire(r) for r in reports], heartbeats=list(heartbeats),
                              probes=[codec.probe_to_pb(p) for p in probes])
