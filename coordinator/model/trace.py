"""The trace format (version 1): what a run records and what ``resihp detect`` replays.

JSON Lines. Line 1 is the header; every later line is one record with a ``type``:

- ``iteration``: one training iteration (observed time, packed sequence lengths of every
  micro-batch of every replica, optional per-rank chunk timings);
- ``heartbeat`` / ``exit``: liveness events of a rank;
- ``plan``: the layout changed (a reconfiguration) from ``iteration`` on.

See docs/trace-format.md. Parsing is strict: a malformed line raises TraceError naming
the line and the field. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

import json
import math
import signal
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError

FORMAT = 1
# TP: the seconds a rank spent inside tensor-parallel collectives during its F or B op of the
# same micro-batch, recorded as one span that ends with the op (docs/trace-format.md)
CHUNK_KINDS = ("F", "B", "W", "P2P", "DP", "OPT", "TP")
COMPUTE_KINDS = ("F", "B", "W")


class TraceError(ValueError):
    def __init__(self, line: int, field_name: str, message: str) -> None:
        self.line = line
        self.field = field_name
        super().__init__(f"line {line}: field {field_name!r}: {message}")


@dataclass(frozen=True)
class DeviceInfo:
    rank: int
    node: str
    local_rank: int = 0


@dataclass(frozen=True)
class TraceHeader:
    model: ModelSpec
    plan: Plan
    devices: tuple[DeviceInfo, ...]
    job: str = ""
    tokens_per_microbatch: int = 0  # the packing budget (e.g. 8192); 0 = unknown
    meta: Mapping[str, Any] = field(default_factory=dict)

    def known_nodes(self) -> dict[int, str]:
        """rank -> node, for the ranks whose node the header names."""
        return {d.rank: d.node for d in self.devices if d.node}

    def node_of(self, rank: int) -> str:
        for d in self.devices:
            if d.rank == rank:
                return d.node
        raise KeyError(rank)


@dataclass(frozen=True)
class ChunkTiming:
    """One timed piece of work on one rank, in seconds from the iteration's start.

    kind: F, B, W (compute: forward, backward-input, backward-weight; with 1F1B the
    runtime records B covering both halves and no W), P2P (a pipeline send/recv wait),
    DP (gradient all-reduce), OPT (optimizer step), TP (time inside tensor-parallel
    collectives during the F or B op of that micro-batch: a span within the op, ending
    with it, whose duration alone means something). ``chunk`` is the virtual-stage chunk
    index under interleaving, else 0; ``microbatch`` is -1 for DP and OPT.
    """

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_list(self) -> list[Any]:
        return [self.rank, self.kind, self.microbatch, self.chunk, round(self.start_s, 9), round(self.end_s, 9)]


@dataclass(frozen=True)
class IterationRecord:
    iteration: int
    start_s: float  # wall clock (job-relative) at the iteration's start
    time_s: float  # observed iteration time
    # seqlens[replica][microbatch] = lengths of the documents packed in that micro-batch
    seqlens: tuple[tuple[tuple[int, ...], ...], ...]
    chunks: tuple[ChunkTiming, ...] = ()
    # per-rank whole-step time where chunk timings are absent (coarser evidence)
    rank_step_s: Mapping[int, float] = field(default_factory=dict)


OP_KINDS = ("compute", "p2p", "collective")
WAITING_OPS = ("p2p", "collective")  # an op that blocks until a peer does its part


@dataclass(frozen=True)
class OpState:
    """The operation a rank entered last (hang localisation, docs/trace-format.md): its kind
    (``OP_KINDS``), a name for people ("F mb3", "DP all-reduce"), whether the rank completed
    it, and a per-rank counter. A rank inside a p2p or collective op that it has not completed
    waits for a peer; one inside a compute op, or between ops, waits for nobody."""

    kind: str
    name: str
    done: bool
    seq: int = 0

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op kind must be one of {OP_KINDS}, got {self.kind!r}")
        if not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"op seq must be a counter >= 0, got {self.seq!r}")
        if len(self.name) > 80:
            raise ValueError(f"op name must be at most 80 characters, got {len(self.name)}")

    @property
    def waiting(self) -> bool:
        return self.kind in WAITING_OPS and not self.done

    def describe(self) -> str:
        return f"{'after' if self.done else 'in'} {self.kind} op {self.name!r} (#{self.seq})"


@dataclass(frozen=True)
class HeartbeatEvent:
    rank: int
    time_s: float
    op: OpState | None = None  # the op it is in, where the writer records one


# ExitEvent.code (and RankExit.code) when the agent could not read the exit status (the process
# was reaped by its parent first); outside every signal number, so never read as "signal 1"
EXIT_UNKNOWN = -1000


def describe_exit(code: int) -> str:
    """An exit status as people read it: "was killed by signal 9 (SIGKILL)", "exited with code 3"."""
    if code == EXIT_UNKNOWN:
        return "exited (status unknown: the process was reaped before its agent could read it)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"was killed by signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


@dataclass(frozen=True)
class ExitEvent:
    rank: int
    time_s: float
    code: int  # negative = killed by signal -code; EXIT_UNKNOWN = not known


@dataclass(frozen=True)
class PlanChange:
    iteration: int  # first iteration run with the new plan
    plan: Plan


Record = IterationRecord | HeartbeatEvent | ExitEvent | PlanChange


# --- writing ------------------------------------------------------------------------------
def header_to_dict(h: TraceHeader) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "type": "header",
        "job": h.job,
        "model": h.model.to_dict(),
        "plan": h.plan.to_dict(),
        "devices": [{"rank": d.rank, "node": d.node, "local_rank": d.local_rank} for d in h.devices],
        "tokens_per_microbatch": h.tokens_per_microbatch,
        "meta": dict(h.meta),
    }


def record_to_dict(rec: Record) -> dict[str, Any]:
    if isinstance(rec, IterationRecord):
        out: dict[str, Any] = {
            "type": "iteration",
            "iteration": rec.iteration,
            "start_s": round(rec.start_s, 9),
            "time_s": round(rec.time_s, 9),
            "seqlens": [[list(mb) for mb in rep] for rep in rec.seqlens],
        }
        if rec.chunks:
            out["chunks"] = [c.to_list() for c in rec.chunks]
        if rec.rank_step_s:
            out["rank_step_s"] = {str(k): round(v, 9) for k, v in sorted(rec.rank_step_s.items())}
        return out
    if isinstance(rec, HeartbeatEvent):
        beat: dict[str, Any] = {"type": "heartbeat", "rank": rec.rank, "time_s": rec.time_s}
        if rec.op is not None:
            beat["op"] = {"kind": rec.op.kind, "name": rec.op.name, "done": rec.op.done, "seq": rec.op.seq}
        return beat
    if isinstance(rec, ExitEvent):
        return {"type": "exit", "rank": rec.rank, "time_s": rec.time_s, "code": rec.code}
    if isinstance(rec, PlanChange):
        return {"type": "plan", "iteration": rec.iteration, "plan": rec.plan.to_dict()}
    raise TypeError(f"not a trace record: {rec!r}")


def _op(obj: Mapping[str, Any], line: int) -> OpState | None:
    raw = obj.get("op")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TraceError(line, "op", 'must be an object {"kind", "name", "done", "seq"}')
    kind, name, done, seq = raw.get("kind"), raw.get("name", ""), raw.get("done"), raw.get("seq", 0)
    if not isinstance(name, str) or not isinstance(done, bool) or isinstance(seq, bool) or not isinstance(seq, int):
        raise TraceError(line, "op", f"needs kind (string), name (string), done (true/false), seq (integer); got {dict(raw)!r}")
    try:
        return OpState(str(kind), name, done, seq)
    except ValueError as exc:
        raise TraceError(line, "op", str(exc)) from None


def write_trace(out: IO[str], header: TraceHeader, records: Iterable[Record]) -> None:
    out.write(json.dumps(header_to_dict(header), separators=(",", ":")) + "\n")
    for rec in records:
        out.write(json.dumps(record_to_dict(rec), separators=(",", ":")) + "\n")


# --- reading ------------------------------------------------------------------------------
def _get(obj: Mapping[str, Any], key: str, line: int) -> Any:
    if key not in obj:
        raise TraceError(line, key, "missing")
    return obj[key]


def _int(obj: Mapping[str, Any], key: str, line: int, minimum: int | None = 0) -> int:
    value = _get(obj, key, line)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceError(line, key, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise TraceError(line, key, f"must be >= {minimum}, got {value}")
    return value


def _time(value: Any, line: int, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(line, key, f"must be a finite number >= 0 (seconds), got {value!r}")
    return float(value)


def parse_header(obj: Any, line: int = 1) -> TraceHeader:
    if not isinstance(obj, dict):
        raise TraceError(line, "header", "the first line must be a JSON object (the trace header)")
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise TraceError(line, "format", f"unsupported trace format {fmt!r}; this resihp reads format {FORMAT}")
    if obj.get("type", "header") != "header":
        raise TraceError(line, "type", f"the first line must be the header, got type {obj.get('type')!r}")
    try:
        model = ModelSpec.from_dict(_get(obj, "model", line))
    except SpecError as exc:
        raise TraceError(line, "model", str(exc)) from None
    try:
        plan = Plan.from_dict(_get(obj, "plan", line))
        plan.validate_for(model.num_layers, model.num_heads)
    except SpecError as exc:
        raise TraceError(line, "plan", str(exc)) from None
    devices_raw = _get(obj, "devices", line)
    if not isinstance(devices_raw, list):
        raise TraceError(line, "devices", "must be a list of {rank, node}")
    devices = []
    for i, d in enumerate(devices_raw):
        if not isinstance(d, dict):
            raise TraceError(line, f"devices[{i}]", "must be an object with rank and node")
        rank = _int(d, "rank", line)
        devices.append(DeviceInfo(rank=rank, node=str(_get(d, "node", line)), local_rank=int(d.get("local_rank", 0))))
    known = {d.rank for d in devices}
    missing = sorted(set(plan.ranks()) - known)
    if missing:
        raise TraceError(line, "devices", f"plan uses ranks {missing} that are not listed in devices")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceError(line, "meta", "must be an object")
    return TraceHeader(
        model=model, plan=plan, devices=tuple(devices), job=str(obj.get("job", "")),
        tokens_per_microbatch=_int(obj, "tokens_per_microbatch", line) if "tokens_per_microbatch" in obj else 0,
        meta=meta,
    )


def parse_record(obj: Any, line: int, header: TraceHeader, plan: Plan) -> Record:
    if not isinstance(obj, dict):
        raise TraceError(line, "type", "each line must be a JSON object")
    kind = obj.get("type")
    world = {d.rank for d in header.devices}

    def rank_of(o: Mapping[str, Any], key: str = "rank") -> int:
        r = _int(o, key, line)
        if r not in world:
            raise TraceError(line, key, f"unknown rank {r}; the header lists ranks 0..{max(world)}")
        return r

    if kind == "iteration":
        it = _int(obj, "iteration", line)
        start = _time(_get(obj, "start_s", line), line, "start_s")
        time_s = _time(_get(obj, "time_s", line), line, "time_s")
        seq_raw = _get(obj, "seqlens", line)
        if not isinstance(seq_raw, list) or len(seq_raw) != plan.dp:
            raise TraceError(line, "seqlens", f"must list one entry per replica ({plan.dp}), got {_len(seq_raw)}")
        seqlens = []
        for r_idx, rep in enumerate(seq_raw):
            want = plan.replicas[r_idx].microbatches
            if not isinstance(rep, list) or len(rep) != want:
                raise TraceError(line, f"seqlens[{r_idx}]", f"must list {want} micro-batches, got {_len(rep)}")
            mbs = []
            for m_idx, mb in enumerate(rep):
                if not isinstance(mb, list) or not mb or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in mb
                ):
                    raise TraceError(
                        line, f"seqlens[{r_idx}][{m_idx}]", "must be a non-empty list of positive integer lengths"
                    )
                mbs.append(tuple(mb))
            seqlens.append(tuple(mbs))
        chunks = []
        for c_idx, c in enumerate(obj.get("chunks", [])):
            name = f"chunks[{c_idx}]"
            if not isinstance(c, list) or len(c) != 6:
                raise TraceError(line, name, "must be [rank, kind, microbatch, chunk, start_s, end_s]")
            rank, ckind, mb, chunk, s, e = c
            if not isinstance(rank, int) or rank not in world:
                raise TraceError(line, name, f"unknown rank {rank!r}")
            if ckind not in CHUNK_KINDS:
                raise TraceError(line, name, f"kind must be one of {list(CHUNK_KINDS)}, got {ckind!r}")
            if not isinstance(mb, int) or not isinstance(chunk, int):
                raise TraceError(line, name, "microbatch and chunk must be integers")
            s_f, e_f = _time(s, line, name), _time(e, line, name)
            if e_f < s_f:
                raise TraceError(line, name, f"ends ({e_f}) before it starts ({s_f})")
            chunks.append(ChunkTiming(rank, ckind, mb, chunk, s_f, e_f))
        rank_step: dict[int, float] = {}
        raw_steps = obj.get("rank_step_s", {})
        if not isinstance(raw_steps, dict):
            raise TraceError(line, "rank_step_s", "must be an object {rank: seconds}")
        for k, v in raw_steps.items():
            try:
                r = int(k)
            except ValueError:
                raise TraceError(line, "rank_step_s", f"key {k!r} is not a rank") from None
            if r not in world:
                raise TraceError(line, "rank_step_s", f"unknown rank {r}")
            rank_step[r] = _time(v, line, f"rank_step_s[{k}]")
        return IterationRecord(it, start, time_s, tuple(seqlens), tuple(chunks), rank_step)
    if kind == "heartbeat":
        return HeartbeatEvent(rank_of(obj), _time(_get(obj, "time_s", line), line, "time_s"), _op(obj, line))
    if kind == "exit":
        return ExitEvent(rank_of(obj), _time(_get(obj, "time_s", line), line, "time_s"), _int(obj, "code", line, None))
    if kind == "plan":
        try:
            new_plan = Plan.from_dict(_get(obj, "plan", line))
            new_plan.validate_for(header.model.num_layers, header.model.num_heads)
        except SpecError as exc:
            raise TraceError(line, "plan", str(exc)) from None
        return PlanChange(_int(obj, "iteration", line), new_plan)
    raise TraceError(line, "type", f"unknown record type {kind!r}; expected iteration, heartbeat, exit or plan")


def _len(x: Any) -> str:
    return str(len(x)) if isinstance(x, list) else type(x).__name__


def read_trace(lines: Iterable[str]) -> tuple[TraceHeader, Iterator[Record]]:
    """Parse the header eagerly and the records lazily (traces can be long)."""
    it = iter(enumerate(lines, start=1))
    for line_no, text in it:
        if text.strip():
            header = parse_header(_loads(text, line_no), line_no)
            break
    else:
        raise TraceError(1, "header", "the trace is empty")

    def records() -> Iterator[Record]:
        plan = header.plan
        for n, t in it:
            if not t.strip():
                continue
            rec = parse_record(_loads(t, n), n, header, plan)
            if isinstance(rec, PlanChange):
                plan = rec.plan
            yield rec

    return header, records()


def _loads(text: str, line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(line, "json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None


def load_trace(path: str) -> tuple[TraceHeader, list[Record]]:
    with open(path, encoding="utf-8") as fh:
        header, recs = read_trace(fh)
        return header, list(recs)


def seqlens_flat(seqlens: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, ...]]:
    return [tuple(mb) for rep in seqlens for mb in rep]


def trace_tail(lines: Iterable[str], max_iterations: int) -> list[str]:
    """The header, the last plan change before the tail, and the last ``max_iterations``
    iteration records with the records among them: what a reader that only needs the
    recent past (a restarted coordinator's profile) parses of a long trace. Streams: holds
    only the tail."""
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be >= 1, got {max_iterations}")
    body = (t for t in lines if t.strip())
    header = next(body, None)
    if header is None:
        return []
    window: deque[tuple[str, str]] = deque()  # (type, line) from the oldest kept iteration on
    iterations, plan_before = 0, ""
    for text in body:
        kind = _line_type(text)
        window.append((kind, text))
        iterations += kind == "iteration"
        while iterations > max_iterations:
            old_kind, old = window.popleft()
            iterations -= old_kind == "iteration"
            plan_before = old if old_kind == "plan" else plan_before
    return [header, *([plan_before] if plan_before else []), *(t for _, t in window)]


def _line_type(text: str) -> str:
    """A record line's ``type`` from its first characters (writers put it first), parsing
    the whole line only when it is not there."""
    head = text.lstrip()[:40].replace(" ", "")
    if head.startswith('{"type":"'):
        return head[len('{"type":"'):].split('"', 1)[0]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return ""
    return str(obj.get("type", "")) if isinstance(obj, dict) else ""
