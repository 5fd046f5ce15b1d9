"""The one place protobuf messages become dataclasses and back.

Decoding validates what it can without job context (finite non-negative times, sizes,
chunk kinds) and raises ``ValidationError`` with a message naming the field; servers map
it to INVALID_ARGUMENT. Checks that need the job (rank in range, known epoch) live in the
services.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.model.trace import CHUNK_KINDS, ChunkTiming, OpState
from resihp.coordinator.protocol import messages as m
from resihp.proto import resihp_pb2 as pb

# Size caps: far above any real job, low enough that no message can exhaust a daemon.
MAX_MICROBATCHES = 4096
MAX_SEQS_PER_MICROBATCH = 65536
MAX_SEQLEN = 1 << 24
MAX_CHUNKS = 65536
MAX_RANK = 1 << 20
MAX_TEXT = 4096
MAX_BATCH_ITEMS = 100_000
MAX_FACTOR = 1000.0
MAX_MODEL_JSON = 1 << 16  # a ModelSpec's JSON (block list, TP plan): a few KiB in practice
_INF = math.inf


class ValidationError(ValueError):
    """A request that cannot be accepted; the message says which field and why."""


def _time(value: float, name: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValidationError(f"{name} must be a finite number >= 0 (seconds), got {value!r}")
    return float(value)


def _rank(value: int, name: str) -> int:
    if value < 0 or value > MAX_RANK:
        raise ValidationError(f"{name} must be a rank in 0..{MAX_RANK}, got {value}")
    return int(value)


def _nonneg(value: int, name: str) -> int:
    if value < 0:
        raise ValidationError(f"{name} must be >= 0, got {value}")
    return int(value)


def _text(value: str, name: str) -> str:
    if len(value) > MAX_TEXT:
        raise ValidationError(f"{name} is {len(value)} characters long; the limit is {MAX_TEXT}")
    return value


def _cap(items: Any, limit: int, name: str) -> None:
    if len(items) > limit:
        raise ValidationError(f"{name} has {len(items)} entries; the limit is {limit}")


# --- plan --------------------------------------------------------------------------------
def plan_to_json(plan: Plan | None) -> str:
    return "" if plan is None else json.dumps(plan.to_dict(), separators=(",", ":"), sort_keys=True)


def plan_from_json(text: str, name: str = "plan_json") -> Plan | None:
    if not text:
        return None
    try:
        return Plan.from_dict(json.loads(text))
    except (json.JSONDecodeError, SpecError, TypeError, ValueError) as exc:
        raise ValidationError(f"{name} is not a valid plan: {exc}") from None


# --- reports -----------------------------------------------------------------------------
def chunk_to_pb(c: ChunkTiming) -> pb.ChunkTiming:
    return pb.ChunkTiming(rank=c.rank, kind=c.kind, microbatch=c.microbatch, chunk=c.chunk, start_s=c.start_s,
                          end_s=c.end_s)


def chunk_from_pb(c: pb.ChunkTiming, name: str) -> ChunkTiming:
    _rank(c.rank, f"{name}.rank")
    if c.kind not in CHUNK_KINDS:
        raise ValidationError(f"{name}.kind must be one of {list(CHUNK_KINDS)}, got {c.kind!r}")
    start, end = _time(c.start_s, f"{name}.start_s"), _time(c.end_s, f"{name}.end_s")
    if end < start:
        raise ValidationError(f"{name} ends ({end}) before it starts ({start})")
    if c.microbatch < -1 or c.chunk < 0:
        raise ValidationError(f"{name}: microbatch must be >= -1 and chunk >= 0")
    return ChunkTiming(_rank(c.rank, f"{name}.rank"), c.kind, c.microbatch, c.chunk, start, end)


def report_to_pb(r: m.RankReport) -> pb.RankReport:
    return pb.RankReport(
        rank=r.rank, epoch=r.epoch, iteration=r.iteration, start_s=r.start_s, step_s=r.step_s,
        microbatches=[pb.MicroBatch(seqlens=list(mb)) for mb in r.seqlens],
        chunks=[chunk_to_pb(c) for c in r.chunks],
    )


def check_report_pb(r: pb.RankReport, name: str = "report") -> tuple[int, int]:
    """Validate one report without converting it (the agent forwards it as received);
    returns (rank, iteration). Raises ValidationError naming the field.

    The valid case reads each field once with chained comparisons (a NaN or an infinity
    fails them); anything suspicious goes to ``report_from_pb``, which names the field."""
    rank, it, start_s, step_s = r.rank, r.iteration, r.start_s, r.step_s
    mbs, chunks = r.microbatches, r.chunks
    if (not 0 <= rank <= MAX_RANK or r.epoch < 0 or it < 0 or not 0.0 <= start_s < _INF
            or not 0.0 <= step_s < _INF or len(mbs) > MAX_MICROBATCHES or len(chunks) > MAX_CHUNKS):
        report_from_pb(r, name)  # raises with the precise message
    for mb in mbs:
        seq = mb.seqlens
        if not seq or len(seq) > MAX_SEQS_PER_MICROBATCH or min(seq) <= 0 or max(seq) > MAX_SEQLEN:
            report_from_pb(r, name)
    for c in chunks:
        if not (c.kind in CHUNK_KINDS and 0.0 <= c.start_s <= c.end_s < _INF and c.microbatch >= -1
                and c.chunk >= 0 and 0 <= c.rank <= MAX_RANK):
            report_from_pb(r, name)
    return rank, it


def check_heartbeat_pb(h: pb.RankHeartbeat, name: str = "heartbeat") -> tuple[int, int]:
    """Validate a hook heartbeat without converting it; returns (rank, iteration)."""
    rank, it = h.rank, h.iteration
    if not (0 <= rank <= MAX_RANK and it >= -1 and 0.0 <= h.time_s < _INF):
        heartbeat_from_pb(h, name)  # raises with the precise message
    return rank, it


def report_from_pb(r: pb.RankReport, name: str = "report") -> m.RankReport:
    """Validate and convert one report. The common (valid) case runs cheap checks only; field
    names for error messages are formatted when something is wrong."""
    rank = r.rank
    if not 0 <= rank <= MAX_RANK:
        _rank(rank, f"{name}.rank")
    _cap(r.microbatches, MAX_MICROBATCHES, f"{name}.microbatches")
    _cap(r.chunks, MAX_CHUNKS, f"{name}.chunks")
    seqlens = []
    for i, mb in enumerate(r.microbatches):
        seq = tuple(mb.seqlens)
        if not seq:
            raise ValidationError(f"{name}.microbatches[{i}] has no sequence lengths; list at least one")
        if len(seq) > MAX_SEQS_PER_MICROBATCH or min(seq) <= 0 or max(seq) > MAX_SEQLEN:
            _cap(seq, MAX_SEQS_PER_MICROBATCH, f"{name}.microbatches[{i}].seqlens")
            raise ValidationError(f"{name}.microbatches[{i}].seqlens must be in 1..{MAX_SEQLEN}, got "
                                  f"{[x for x in seq if x <= 0 or x > MAX_SEQLEN][:3]}")
        seqlens.append(seq)
    chunks = []
    for i, c in enumerate(r.chunks):
        kind, start, end = c.kind, c.start_s, c.end_s
        if (kind not in CHUNK_KINDS or not 0.0 <= start <= end or not math.isfinite(end) or c.microbatch < -1
                or c.chunk < 0 or not 0 <= c.rank <= MAX_RANK):
            chunk_from_pb(c, f"{name}.chunks[{i}]")  # raises with the precise field
        chunks.append(ChunkTiming(c.rank, kind, c.microbatch, c.chunk, start, end))
    epoch, iteration, start_s, step_s = r.epoch, r.iteration, r.start_s, r.step_s
    if epoch < 0 or iteration < 0:
        _nonneg(epoch, f"{name}.epoch")
        _nonneg(iteration, f"{name}.iteration")
    if not (0.0 <= start_s and 0.0 <= step_s and math.isfinite(start_s) and math.isfinite(step_s)):
        _time(start_s, f"{name}.start_s")
        _time(step_s, f"{name}.step_s")
    return m.RankReport(rank, epoch, iteration, start_s, step_s, tuple(seqlens), tuple(chunks))


def heartbeat_to_pb(h: m.RankHeartbeat) -> pb.RankHeartbeat:
    out = pb.RankHeartbeat(rank=h.rank, time_s=h.time_s, iteration=h.iteration)
    if h.op is not None:
        out.op_kind, out.op_name, out.op_done, out.op_seq = h.op.kind, h.op.name, h.op.done, h.op.seq
    return out


def heartbeat_op_from_pb(h: pb.RankHeartbeat, name: str = "heartbeat") -> OpState | None:
    """The op a heartbeat names (``op_kind`` empty: none), validated."""
    if not h.op_kind:
        return None
    try:
        return OpState(h.op_kind, h.op_name, bool(h.op_done), int(h.op_seq))
    except ValueError as exc:
        raise ValidationError(f"{name}: {exc}") from None


def heartbeat_from_pb(h: pb.RankHeartbeat, name: str = "heartbeat") -> m.RankHeartbeat:
    if h.iteration < -1:
        raise ValidationError(f"{name}.iteration must be >= -1, got {h.iteration}")
    return m.RankHeartbeat(_rank(h.rank, f"{name}.rank"), _time(h.time_s, f"{name}.time_s"), h.iteration,
                           heartbeat_op_from_pb(h, name))


def probe_to_pb(p: m.RankProbe) -> pb.RankProbe:
    return pb.RankProbe(rank=p.rank, time_s=p.time_s, probe_s=p.probe_s)


def probe_from_pb(p: pb.RankProbe, name: str = "probe") -> m.RankProbe:
    if not (math.isfinite(p.probe_s) and p.probe_s > 0):
        raise ValidationError(f"{name}.probe_s must be a finite duration > 0 seconds, got {p.probe_s!r}")
    return m.RankProbe(_rank(p.rank, f"{name}.rank"), _time(p.time_s, f"{name}.time_s"), float(p.probe_s))


# --- commands and acks -------------------------------------------------------------------
def command_to_pb(c: m.Command) -> pb.Command:
    out = pb.Command(seq=c.seq, epoch=c.epoch, apply_at=c.apply_at, reason=c.reason, ranks=list(c.ranks),
                     issued_s=c.issued_s)
    if isinstance(c, m.ReconfigCommand):
        out.reconfigure.plan_json = plan_to_json(c.plan)
    elif isinstance(c, m.ThrottleCommand):
        out.throttle.factor = c.factor
    elif isinstance(c, m.NoticeCommand):
        out.notice.CopyFrom(pb.Notice(kind=c.kind, text=c.text, rank=c.rank, cause=c.cause, code=c.code,
                                      time_s=c.time_s, iteration=c.iteration))
    else:
        out.drain.SetInParent()
    return out


def command_from_pb(c: pb.Command) -> m.Command:
    common: dict[str, Any] = dict(
        epoch=_nonneg(c.epoch, "command.epoch"), apply_at=_nonneg(c.apply_at, "command.apply_at"),
        reason=_text(c.reason, "command.reason"), seq=_nonneg(c.seq, "command.seq"),
        ranks=tuple(_rank(r, "command.ranks") for r in c.ranks), issued_s=c.issued_s,
    )
    body = c.WhichOneof("body")
    if body == "reconfigure":
        plan = plan_from_json(c.reconfigure.plan_json, "command.reconfigure.plan_json")
        if plan is None:
            raise ValidationError("command.reconfigure.plan_json is empty")
        return m.ReconfigCommand(plan=plan, **common)
    if body == "throttle":
        f = c.throttle.factor
        if not math.isfinite(f) or f <= 0 or f > MAX_FACTOR:
            raise ValidationError(f"command.throttle.factor must be in (0, {MAX_FACTOR}], got {f}")
        return m.ThrottleCommand(factor=f, **common)
    if body == "drain":
        return m.DrainCommand(**common)
    if body == "notice":
        n = c.notice
        if n.kind not in m.NOTICE_KINDS:
            raise ValidationError(f"command.notice.kind must be one of {list(m.NOTICE_KINDS)}, got {n.kind!r}")
        if n.rank < -1 or n.rank > MAX_RANK:
            raise ValidationError(f"command.notice.rank must be -1 or a rank in 0..{MAX_RANK}, got {n.rank}")
        return m.NoticeCommand(text=_text(n.text, "command.notice.text"), kind=n.kind, rank=n.rank,
                               cause=_text(n.cause, "command.notice.cause"), code=n.code,
                               time_s=_time(n.time_s, "command.notice.time_s"), iteration=max(n.iteration, -1),
                               **common)
    raise ValidationError("command has no body (reconfigure, throttle, drain or notice)")


def ack_to_pb(a: m.Ack) -> pb.Ack:
    return pb.Ack(rank=a.rank, seq=a.seq, epoch=a.epoch, iteration=a.iteration, ok=a.ok, error=a.error,
                  time_s=a.time_s)


def ack_from_pb(a: pb.Ack, name: str = "ack") -> m.Ack:
    return m.Ack(
        rank=_rank(a.rank, f"{name}.rank"), seq=_nonneg(a.seq, f"{name}.seq"), epoch=_nonneg(a.epoch, f"{name}.epoch"),
        iteration=_nonneg(a.iteration, f"{name}.iteration"), ok=a.ok, error=_text(a.error, f"{name}.error"),
        time_s=_time(a.time_s, f"{name}.time_s"),
    )


# --- agent stream ------------------------------------------------------------------------
def local_rank_to_pb(r: m.LocalRank) -> pb.LocalRank:
    return pb.LocalRank(rank=r.rank, local_rank=r.local_rank, pid=r.pid, reshapes=r.reshapes, model_json=r.model_json)


def check_model_json(text: str, name: str) -> str:
    """A trainer's ModelSpec as JSON: "" or a JSON object of at most MAX_MODEL_JSON characters."""
    if not text:
        return ""
    if len(text) > MAX_MODEL_JSON:
        raise ValidationError(f"{name} is {len(text)} characters long; the limit is {MAX_MODEL_JSON}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{name} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError(f"{name} must be a JSON object (ModelSpec.to_dict), got {type(data).__name__}")
    return text


def local_rank_from_pb(r: pb.LocalRank, name: str) -> m.LocalRank:
    return m.LocalRank(_rank(r.rank, f"{name}.rank"), _nonneg(r.local_rank, f"{name}.local_rank"),
                       _nonneg(r.pid, f"{name}.pid"), r.reshapes, check_model_json(r.model_json, f"{name}.model_json"))


def gpu_to_pb(g: m.GpuSample) -> pb.GpuSample:
    return pb.GpuSample(
        gpu=g.gpu, uuid=g.uuid, model_name=g.model_name, time_s=g.time_s, sm_clock_hz=g.sm_clock_hz,
        sm_clock_max_hz=g.sm_clock_max_hz, clock_event_reasons=g.clock_event_reasons,
        temperature_celsius=g.temperature_celsius, power_watts=g.power_watts,
        ecc_corrected_total=g.ecc_corrected_total, ecc_uncorrected_total=g.ecc_uncorrected_total,
        xid_events=list(g.xid_events),
    )


def gpu_from_pb(g: pb.GpuSample, name: str) -> m.GpuSample:
    _cap(g.xid_events, 1024, f"{name}.xid_events")
    for fname in ("sm_clock_hz", "sm_clock_max_hz", "power_watts"):
        _time(getattr(g, fname), f"{name}.{fname}")  # same rule: finite, >= 0
    if not math.isfinite(g.temperature_celsius):
        raise ValidationError(f"{name}.temperature_celsius must be finite")
    return m.GpuSample(
        gpu=_nonneg(g.gpu, f"{name}.gpu"), time_s=_time(g.time_s, f"{name}.time_s"),
        uuid=_text(g.uuid, f"{name}.uuid"), model_name=_text(g.model_name, f"{name}.model_name"),
        sm_clock_hz=g.sm_clock_hz, sm_clock_max_hz=g.sm_clock_max_hz, clock_event_reasons=g.clock_event_reasons,
        temperature_celsius=g.temperature_celsius, power_watts=g.power_watts,
        ecc_corrected_total=g.ecc_corrected_total, ecc_uncorrected_total=g.ecc_uncorrected_total,
        xid_events=tuple(g.xid_events),
    )


def process_to_pb(p: m.ProcessSample) -> pb.ProcessSample:
    return pb.ProcessSample(rank=p.rank, pid=p.pid, time_s=p.time_s, cpu_seconds_total=p.cpu_seconds_total,
                            rss_bytes=p.rss_bytes)


def process_from_pb(p: pb.ProcessSample, name: str) -> m.ProcessSample:
    return m.ProcessSample(_rank(p.rank, f"{name}.rank"), _nonneg(p.pid, f"{name}.pid"),
                           _time(p.time_s, f"{name}.time_s"), _time(p.cpu_seconds_total, f"{name}.cpu_seconds_total"),
                           p.rss_bytes)


def exit_to_pb(e: m.RankExit) -> pb.RankExit:
    return pb.RankExit(rank=e.rank, pid=e.pid, time_s=e.time_s, code=e.code, clean=e.clean)


def exit_from_pb(e: pb.RankExit, name: str) -> m.RankExit:
    return m.RankExit(_rank(e.rank, f"{name}.rank"), _nonneg(e.pid, f"{name}.pid"), _time(e.time_s, f"{name}.time_s"),
                      e.code, e.clean)


def agent_batch_to_pb(b: m.AgentBatch) -> pb.AgentMessage:
    out = pb.AgentMessage(
        agent_id=b.agent_id, node=b.node, reports=[report_to_pb(r) for r in b.reports] + list(b.raw_reports),
        acks=[ack_to_pb(a) for a in b.acks], exits=[exit_to_pb(e) for e in b.exits],
        gpus=[gpu_to_pb(g) for g in b.gpus], processes=[process_to_pb(p) for p in b.processes],
        joined=[local_rank_to_pb(r) for r in b.joined],
        injections=[pb.InjectResult(kind=i.kind, rank=i.rank, ok=i.ok, detail=i.detail) for i in b.injections],
        probes=[probe_to_pb(p) for p in b.probes],
    )
    if b.heartbeat is not None:
        h = b.heartbeat
        out.heartbeat.CopyFrom(pb.AgentHeartbeat(
            time_s=h.time_s, ranks=[heartbeat_to_pb(r) for r in h.ranks], sampler_degraded=h.sampler_degraded,
            sampler_status=h.sampler_status,
        ))
    return out


def agent_batch_from_pb(b: pb.AgentMessage) -> m.AgentBatch:
    total = (len(b.reports) + len(b.acks) + len(b.exits) + len(b.gpus) + len(b.processes) + len(b.joined)
             + len(b.probes))
    if total > MAX_BATCH_ITEMS:
        raise ValidationError(f"agent message carries {total} items; the limit is {MAX_BATCH_ITEMS}")
    hb = None
    if b.HasField("heartbeat"):
        h = b.heartbeat
        _cap(h.ranks, MAX_BATCH_ITEMS, "heartbeat.ranks")
        hb = m.AgentHeartbeat(
            time_s=_time(h.time_s, "heartbeat.time_s"),
            ranks=tuple(heartbeat_from_pb(r, f"heartbeat.ranks[{i}]") for i, r in enumerate(h.ranks)),
            sampler_degraded=h.sampler_degraded, sampler_status=_text(h.sampler_status, "heartbeat.sampler_status"),
        )
    return m.AgentBatch(
        agent_id=_text(b.agent_id, "agent_id"), node=_text(b.node, "node"),
        reports=tuple(report_from_pb(r, f"reports[{i}]") for i, r in enumerate(b.reports)),
        acks=tuple(ack_from_pb(a, f"acks[{i}]") for i, a in enumerate(b.acks)),
        exits=tuple(exit_from_pb(e, f"exits[{i}]") for i, e in enumerate(b.exits)),
        gpus=tuple(gpu_from_pb(g, f"gpus[{i}]") for i, g in enumerate(b.gpus)),
        processes=tuple(process_from_pb(p, f"processes[{i}]") for i, p in enumerate(b.processes)),
        joined=tuple(local_rank_from_pb(r, f"joined[{i}]") for i, r in enumerate(b.joined)),
        injections=tuple(m.InjectResult(i.kind, i.rank, i.ok, _text(i.detail, "injections.detail"))
                         for i in b.injections),
        heartbeat=hb,
        probes=tuple(probe_from_pb(p, f"probes[{i}]") for i, p in enumerate(b.probes)),
    )


def coordinator_batch_to_pb(b: m.CoordinatorBatch) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        commands=[command_to_pb(c) for c in b.commands],
        orders=[pb.AgentOrder(kill=pb.KillRank(rank=k.rank, reason=k.reason, fence=k.fence, pid=k.pid))
                for k in b.kills],
    )


def coordinator_batch_from_pb(b: pb.CoordinatorMessage) -> m.CoordinatorBatch:
    kills = tuple(m.KillOrder(o.kill.rank, o.kill.reason, o.kill.fence, o.kill.pid)
                  for o in b.orders if o.WhichOneof("body") == "kill")
    return m.CoordinatorBatch(commands=tuple(command_from_pb(c) for c in b.commands), kills=kills)


def registration_to_pb(r: m.Registration) -> pb.RegisterRequest:
    return pb.RegisterRequest(node=r.node, job=r.job, ranks=[local_rank_to_pb(x) for x in r.ranks],
                              address=r.address, sampler_degraded=r.sampler_degraded, sampler_status=r.sampler_status)


def registration_from_pb(r: pb.RegisterRequest) -> m.Registration:
    if not r.node:
        raise ValidationError("register.node is empty; every agent names its node")
    _cap(r.ranks, MAX_BATCH_ITEMS, "register.ranks")
    return m.Registration(
        node=_text(r.node, "register.node"), job=_text(r.job, "register.job"),
        ranks=tuple(local_rank_from_pb(x, f"register.ranks[{i}]") for i, x in enumerate(r.ranks)),
        address=_text(r.address, "register.address"), sampler_degraded=r.sampler_degraded,
        sampler_status=_text(r.sampler_status, "register.sampler_status"),
    )


def welcome_to_pb(w: m.Welcome) -> pb.RegisterReply:
    return pb.RegisterReply(agent_id=w.agent_id, epoch=w.epoch, last_seq=w.last_seq, world_size=w.world_size,
                            heartbeat_interval_s=w.heartbeat_interval_s, plan_json=plan_to_json(w.plan))


def welcome_from_pb(w: pb.RegisterReply) -> m.Welcome:
    return m.Welcome(w.agent_id, w.epoch, w.last_seq, w.world_size, w.heartbeat_interval_s,
                     plan_from_json(w.plan_json))


def reports_from_pb(items: Iterable[pb.RankReport]) -> list[m.RankReport]:
    return [report_from_pb(r, f"reports[{i}]") for i, r in enumerate(items)]
