"""Adversarial requests for every RPC of the Hook, Coordinator and Admin services.

A case is a well-formed message, or one with exactly one named poison (a NaN or negative
time, an unknown rank, a stale or future epoch, a wrong job, a repeated field past its cap,
a broken packed array ...), or raw bytes (random, or a real message cut short or with a bit
flipped), each sent with the right credential or with a missing or wrong one. Every case
says which status codes are a right answer: a poisoned message must be refused (never OK),
and nothing may be INTERNAL or UNKNOWN. Generation is a pure function of a seeded
``random.Random``, so a failing case is replayed from its seed and index.

``mutate_state=False`` keeps to what a live job can take: only refused requests (poisoned,
unauthenticated, undecodable) and read-only calls, never a valid write such as a drain, a
kill or a rank's hello.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from resihp.coordinator.model.trace import CHUNK_KINDS
from resihp.coordinator.protocol import codec
from resihp.proto import resihp_pb2 as pb

S = grpc.StatusCode
REFUSED = frozenset({S.INVALID_ARGUMENT, S.FAILED_PRECONDITION, S.NOT_FOUND, S.OUT_OF_RANGE})
CLEAR = REFUSED | {S.OK}  # a valid request may still be refused for the job's state
DENIED = frozenset({S.UNAUTHENTICATED})
BAD_TIMES = (math.nan, math.inf, -math.inf, -1.0, -1e-9, -1e300)
NO_SUCH_PID_BASE = 1 << 22  # above Linux's largest pid_max: a hello never names a real process
HOOK, COORD, ADMIN = "resihp.v1.Hook", "resihp.v1.Coordinator", "resihp.v1.Admin"


@dataclass(frozen=True)
class Case:
    """One call: ``shape`` is unary | client_stream | server_stream | bidi; ``requests`` are the
    serialized messages (a stream's, in order); ``cancel`` ends a client stream before it is done."""

    service: str
    method: str
    shape: str
    requests: tuple[bytes, ...]
    expect: frozenset[grpc.StatusCode]
    what: str
    credential: str = "good"  # good | none | wrong | other-service | no-bearer
    cancel: bool = False

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method}"


@dataclass
class Target:
    """What the generator knows of the job under test."""

    world: int
    job: str
    agent_ids: list[str] = field(default_factory=list)  # registered by the runner, for Stream cases
    hook_token: bool = True  # the agent asks for the ranks' credential
    coordinator_token: bool = True


SHAPES = {("Hook", "ReportStream"): "client_stream", ("Hook", "Commands"): "server_stream",
          ("Coordinator", "Stream"): "bidi"}
REQUEST_TYPES: dict[str, Any] = {
    f"{svc.full_name}/{meth.name}": getattr(pb, meth.input_type.name)
    for svc in pb.DESCRIPTOR.services_by_name.values() for meth in svc.methods}
READ_ONLY = {f"{ADMIN}/Status", f"{ADMIN}/GetPlan", f"{ADMIN}/Events", f"{HOOK}/Commands"}


class CaseGenerator:
    """``case()`` draws the next case; the same seed gives the same sequence."""

    def __init__(self, rng: random.Random, target: Target, *, mutate_state: bool = True,
                 services: tuple[str, ...] = (HOOK, COORD, ADMIN)) -> None:
        self.rng, self.t, self.mutate_state = rng, target, mutate_state
        self.methods = [(s, m) for s in services for m in _METHODS[s]]
        self._stream = False  # drawing an AgentMessage

    # --- values ---------------------------------------------------------------------------
    def time(self) -> float:
        return self.rng.uniform(0, 2e9)

    def bad_time(self) -> float:
        return self.rng.choice(BAD_TIMES)

    def rank(self) -> int:
        return self.rng.randrange(self.t.world)

    def bad_rank(self) -> int:
        # on the agent stream the coordinator drops (and counts) items of ranks outside the job
        # but inside MAX_RANK, and the stream goes on: there only a rank past MAX_RANK is refused
        outside_job = () if self._stream else (self.t.world, self.t.world + 7)
        return int(self.rng.choice((-1, -(2 ** 31), *outside_job, codec.MAX_RANK + 1, 2 ** 31 - 1)))

    def epoch(self) -> int:  # stale, current-ish and future epochs all decode; the coordinator drops the unknown
        return self.rng.choice((0, 1, 2, 5, 10 ** 6, 2 ** 62))

    def pid(self) -> int:
        return NO_SUCH_PID_BASE + self.rng.randrange(1 << 20)

    def text(self, long: bool = False) -> str:
        n = self.rng.choice((codec.MAX_TEXT + 1, 20000)) if long else self.rng.randrange(12)
        return "".join(self.rng.choice("ab-_.😀\x00 é") for _ in range(n))

    def pick(self, poisons: dict[str, Callable[[], object]]) -> str | None:
        """Apply one named poison: about half the time, or always where valid writes are off."""
        if self.mutate_state and self.rng.random() < 0.5:
            return None
        name = self.rng.choice(sorted(poisons))
        poisons[name]()
        return name

    # --- messages ------------------------------------------------------------------------
    def report(self, rank: int | None = None) -> pb.RankReport:
        rank = self.rank() if rank is None else rank
        n_mb = self.rng.randint(0, 4)
        seqs = [[self.rng.randint(1, 8192) for _ in range(self.rng.randint(1, 3))] for _ in range(n_mb)]
        kinds = [self.rng.choice(CHUNK_KINDS) for _ in range(self.rng.randint(0, 6))]
        starts = [self.rng.uniform(0, 5) for _ in kinds]
        r = pb.RankReport(rank=rank, epoch=self.epoch(), iteration=self.rng.randrange(10 ** 6),
                          start_s=self.time(), step_s=self.rng.uniform(0, 10))
        if self.rng.random() < 0.5:  # packed form, what the hook client sends
            r.seqlens_count.extend(len(s) for s in seqs)
            r.seqlens_flat.extend(x for s in seqs for x in s)
            if kinds:
                pc = r.packed_chunks
                pc.kinds = ",".join(kinds)
                pc.microbatch.extend(self.rng.randint(-1, 3) for _ in kinds)
                pc.chunk.extend(self.rng.randint(0, 2) for _ in kinds)
                pc.start_s.extend(starts)
                pc.end_s.extend(s + self.rng.uniform(0, 1) for s in starts)
        else:
            r.microbatches.extend(pb.MicroBatch(seqlens=s) for s in seqs)
            r.chunks.extend(pb.ChunkTiming(rank=rank, kind=k, microbatch=self.rng.randint(-1, 3), chunk=0,
                                           start_s=s, end_s=s + 0.1) for k, s in zip(kinds, starts))
        return r

    def poison_report(self, r: pb.RankReport) -> str:
        rng = self.rng
        packed = len(r.seqlens_count) > 0 or r.HasField("packed_chunks")

        def chunk_field() -> None:
            if packed:
                _packed_append(r.packed_chunks, "F", rng.choice((1.0, self.bad_time())),
                               rng.choice((0.5, math.nan, math.inf)))
            else:
                r.chunks.append(pb.ChunkTiming(rank=r.rank, kind="F", start_s=self.bad_time(), end_s=1.0))

        poisons: dict[str, Callable[[], object]] = {
            "rank": lambda: setattr(r, "rank", self.bad_rank()),
            "epoch<0": lambda: setattr(r, "epoch", -rng.randint(1, 2 ** 62)),
            "iteration<0": lambda: setattr(r, "iteration", -1),
            "start_s": lambda: setattr(r, "start_s", self.bad_time()),
            "step_s": lambda: setattr(r, "step_s", self.bad_time()),
            "chunk-time": chunk_field,
        }
        if packed:
            pc = r.packed_chunks
            poisons.update({
                "seqlens_count-sum": lambda: r.seqlens_count.append(3),
                "seqlen<=0": lambda: (r.seqlens_count.append(1), r.seqlens_flat.append(rng.choice((0, -5)))),
                "seqlen-huge": lambda: (r.seqlens_count.append(1), r.seqlens_flat.append(codec.MAX_SEQLEN + 1)),
                "packed-length-mismatch": lambda: pc.start_s.append(0.0),
                "packed-kind": lambda: _packed_append(pc, "ZZ", 0.0, 0.0),
                "too-many-microbatches": lambda: (r.seqlens_count.extend([1] * (codec.MAX_MICROBATCHES + 1)),
                                                  r.seqlens_flat.extend([1] * (codec.MAX_MICROBATCHES + 1))),
                "both-forms": lambda: r.microbatches.append(pb.MicroBatch(seqlens=[1])),
            })
        else:
            poisons.update({
                "empty-microbatch": lambda: r.microbatches.append(pb.MicroBatch()),
                "seqlen<=0": lambda: r.microbatches.append(pb.MicroBatch(seqlens=[4, rng.choice((0, -1))])),
                "chunk-kind": lambda: r.chunks.append(pb.ChunkTiming(rank=r.rank, kind=rng.choice(("", "Q", "f")))),
                "chunk-rank": lambda: r.chunks.append(pb.ChunkTiming(rank=-3, kind="F")),
                "microbatch<-1": lambda: r.chunks.append(pb.ChunkTiming(rank=r.rank, kind="F", microbatch=-2)),
                "too-many-chunks": lambda: r.chunks.extend(
                    [pb.ChunkTiming(rank=r.rank, kind="F")] * (codec.MAX_CHUNKS + 1)),
            })
        name = rng.choice(sorted(poisons))
        poisons[name]()
        return f"report.{name}"

    def heartbeat(self, rank: int | None = None) -> pb.RankHeartbeat:
        h = pb.RankHeartbeat(rank=self.rank() if rank is None else rank, time_s=self.time(),
                             iteration=self.rng.randint(-1, 10 ** 6))
        if self.rng.random() < 0.3:
            h.op_kind, h.op_name = self.rng.choice(("compute", "p2p", "collective")), "F mb1"
            h.op_done, h.op_seq = self.rng.random() < 0.5, self.rng.randrange(1000)
        return h

    def poison_heartbeat(self, h: pb.RankHeartbeat) -> str:
        poisons: dict[str, Callable[[], object]] = {
            "rank": lambda: setattr(h, "rank", self.bad_rank()),
            "time_s": lambda: setattr(h, "time_s", self.bad_time()),
            "iteration<-1": lambda: setattr(h, "iteration", -2),
            "op_kind": lambda: setattr(h, "op_kind", self.rng.choice(("hang", "COMPUTE", "x" * 100))),
            "op_seq<0": lambda: _set(h, op_kind="compute", op_seq=-1),
            "op_name-long": lambda: _set(h, op_kind="p2p", op_name="n" * 81),
        }
        name = self.rng.choice(sorted(poisons))
        poisons[name]()
        return f"heartbeat.{name}"

    def probe(self) -> tuple[pb.RankProbe, str | None]:
        p = pb.RankProbe(rank=self.rank(), time_s=self.time(), probe_s=self.rng.uniform(1e-3, 2))
        return p, self.pick({"rank": lambda: setattr(p, "rank", self.bad_rank()),
                             "time_s": lambda: setattr(p, "time_s", self.bad_time()),
                             "probe_s": lambda: setattr(p, "probe_s", self.rng.choice((0.0, -1.0, math.nan,
                                                                                       math.inf)))})

    def ack(self) -> tuple[pb.Ack, str | None]:
        a = pb.Ack(rank=self.rank(), seq=self.rng.randrange(100), epoch=self.epoch(),
                   iteration=self.rng.randrange(1000), ok=self.rng.random() < 0.5, time_s=self.time())
        return a, self.pick({
            "rank": lambda: setattr(a, "rank", self.bad_rank()), "seq<0": lambda: setattr(a, "seq", -1),
            "epoch<0": lambda: setattr(a, "epoch", -1), "iteration<0": lambda: setattr(a, "iteration", -5),
            "time_s": lambda: setattr(a, "time_s", self.bad_time()),
            "error-long": lambda: setattr(a, "error", self.text(long=True))})

    def report_batch(self) -> tuple[pb.HookReportBatch, str | None]:
        rng = self.rng
        b = pb.HookReportBatch(reports=[self.report() for _ in range(rng.randint(0, 2))],
                               heartbeats=[self.heartbeat() for _ in range(rng.randint(0, 2))],
                               probes=[self.probe()[0] for _ in range(rng.randint(0, 1))])
        if not self.mutate_state or rng.random() < 0.6:
            roll = rng.random()
            if roll < 0.45:
                r = self.report()
                why = self.poison_report(r)
                b.reports.append(r)
                return b, why
            if roll < 0.8:
                h = self.heartbeat()
                why = self.poison_heartbeat(h)
                b.heartbeats.append(h)
                return b, why
            if roll < 0.95:
                p, poison = self.probe()
                while poison is None:
                    p, poison = self.probe()
                b.probes.append(p)
                return b, f"probe.{poison}"
            b.heartbeats.extend([self.heartbeat(0)] * 4097)  # past the agent's MAX_HOOK_BATCH
            return b, "batch-too-large"
        return b, None

    def local_rank(self) -> tuple[pb.LocalRank, str | None]:
        lr = pb.LocalRank(rank=self.rank(), local_rank=self.rng.randrange(8), pid=self.pid(),
                          reshapes=self.rng.random() < 0.5, model_json=self.rng.choice(("", '{"name": "x"}')))
        return lr, self.pick({
            "rank": lambda: setattr(lr, "rank", self.bad_rank()),
            "local_rank<0": lambda: setattr(lr, "local_rank", -1), "pid<0": lambda: setattr(lr, "pid", -7),
            "model_json": lambda: setattr(lr, "model_json", self.rng.choice(("[1]", "{", "null", "x" * 70000)))})

    # --- one case per method ----------------------------------------------------------------
    def _hook(self, method: str) -> tuple[list[bytes], str | None, bool]:
        rng, t = self.rng, self.t
        if method == "Hello":
            h = pb.HookHello(rank=self.rank(), local_rank=rng.randrange(8), pid=self.pid(), job=rng.choice((t.job, "")),
                             reshapes=rng.random() < 0.5, model_json=rng.choice(("", '{"name": "m", "num_layers": 2}')))
            why = self.pick({"rank": lambda: setattr(h, "rank", self.bad_rank()),
                             "pid<=0": lambda: setattr(h, "pid", rng.choice((0, -1, -(2 ** 31)))),
                             "local_rank<0": lambda: setattr(h, "local_rank", rng.choice((-1, -(2 ** 31)))),
                             "job": lambda: setattr(h, "job", t.job + "-other"),
                             "model_json": lambda: setattr(h, "model_json", rng.choice(("[]", "{x", "7", "{}" * 40000)))})
            return [h.SerializeToString()], why, False
        if method in ("Report", "ReportStream"):
            batches = [self.report_batch() for _ in range(rng.randint(1, 3) if method == "ReportStream" else 1)]
            bad = next((w for _, w in batches if w), None)
            return [b.SerializeToString() for b, _ in batches], bad, method == "ReportStream" and rng.random() < 0.1
        if method == "Commands":
            c = pb.CommandsRequest(rank=self.rank(), after_seq=rng.choice((-1, 0, 5, 2 ** 62)))
            why = self.pick({"rank": lambda: setattr(c, "rank", self.bad_rank())})
            return [c.SerializeToString()], why, False
        if method == "Acknowledge":
            a, why = self.ack()
            return [a.SerializeToString()], why, False
        g = pb.Goodbye(rank=self.rank(), pid=self.pid())
        why = self.pick({"rank": lambda: setattr(g, "rank", self.bad_rank())})
        return [g.SerializeToString()], why, False

    def agent_message(self, agent_id: str) -> tuple[pb.AgentMessage, str | None]:
        rng = self.rng
        msg = pb.AgentMessage(agent_id=agent_id, node="fz")
        msg.heartbeat.time_s = self.time()
        msg.heartbeat.ranks.extend(self.heartbeat() for _ in range(rng.randint(0, 2)))
        if rng.random() < 0.3:
            msg.reports.append(self.report())
        if rng.random() < 0.2:
            msg.acks.append(self.ack()[0])
        if rng.random() < 0.2:
            msg.gpus.append(pb.GpuSample(gpu=0, time_s=self.time(), sm_clock_hz=1.4e9, sm_clock_max_hz=1.98e9,
                                         temperature_celsius=60.0, power_watts=300.0))
        if rng.random() < 0.2:
            msg.processes.append(pb.ProcessSample(rank=self.rank(), pid=self.pid(), time_s=self.time(),
                                                  cpu_seconds_total=12.0, rss_bytes=1 << 30))

        def gpu(field_name: str, value: float) -> None:
            g = msg.gpus.add(gpu=0, time_s=self.time())
            setattr(g, field_name, value)

        poisons: dict[str, Callable[[], object]] = {
            "report": lambda: self.poison_report(_added(msg.reports, self.report())),
            "heartbeat.rank": lambda: self.poison_heartbeat(_added(msg.heartbeat.ranks, self.heartbeat())),
            "heartbeat.time_s": lambda: setattr(msg.heartbeat, "time_s", self.bad_time()),
            "ack": lambda: msg.acks.append(pb.Ack(rank=self.rank(), seq=-1)),
            "exit.pid<0": lambda: msg.exits.append(pb.RankExit(rank=self.rank(), pid=-1, time_s=1.0)),
            "exit.time_s": lambda: msg.exits.append(pb.RankExit(rank=self.rank(), pid=self.pid(), time_s=self.bad_time())),
            "gpu.sm_clock_hz": lambda: gpu("sm_clock_hz", self.bad_time()),
            "gpu.temperature": lambda: gpu("temperature_celsius", rng.choice((math.nan, math.inf))),
            "gpu.xid_events": lambda: msg.gpus.add(gpu=0, time_s=1.0).xid_events.extend(range(1025)),
            "gpu.gpu<0": lambda: msg.gpus.add(gpu=-1, time_s=1.0),
            "process.cpu": lambda: msg.processes.add(rank=0, pid=1, time_s=1.0, cpu_seconds_total=self.bad_time()),
            "joined.local_rank<0": lambda: msg.joined.add(rank=0, local_rank=-1, pid=self.pid()),
            "joined.model_json": lambda: msg.joined.add(rank=0, pid=self.pid(), model_json="[not an object]"),
            "injection.detail": lambda: msg.injections.add(kind="kill", rank=0, detail=self.text(long=True)),
            "probe": lambda: msg.probes.add(rank=0, time_s=1.0, probe_s=rng.choice((0.0, math.nan, -2.0))),
            "node-long": lambda: setattr(msg, "node", self.text(long=True)),
        }
        if self.mutate_state and rng.random() < 0.5:
            return msg, None
        name = rng.choice(sorted(poisons))
        self._stream = True
        try:
            poisons[name]()
        finally:
            self._stream = False
        return msg, name

    def _coordinator(self, method: str) -> tuple[list[bytes], str | None, bool]:
        rng, t = self.rng, self.t
        if method == "Register":
            ranks = [self.local_rank() for _ in range(rng.randint(0, 3))]
            r = pb.RegisterRequest(node=f"fz{rng.randrange(4)}", job=rng.choice((t.job, "")), ranks=[x for x, _ in ranks],
                                   address="127.0.0.1", sampler_degraded=True, sampler_status="fuzz")
            why = next((f"ranks.{w}" for _, w in ranks if w), None) or self.pick({
                "node-empty": lambda: setattr(r, "node", ""), "node-long": lambda: setattr(r, "node", self.text(True)),
                "job": lambda: setattr(r, "job", t.job + "-other"),
                "address-long": lambda: setattr(r, "address", self.text(True)),
                "sampler_status-long": lambda: setattr(r, "sampler_status", self.text(True))})
            return [r.SerializeToString()], why, False
        known = bool(t.agent_ids) and rng.random() < 0.8
        agent_id = rng.choice(t.agent_ids) if known else rng.choice(("", "nobody#0", self.text()))
        msgs = [self.agent_message(agent_id) for _ in range(rng.randint(1, 3))]
        out = [x.SerializeToString() for x, _ in msgs]
        why = next((f"message.{w}" for _, w in msgs if w), None)
        if not known:
            why = f"unknown-agent-id{'+' + why if why else ''}"
        elif rng.random() < 0.15:
            out.insert(rng.randrange(1, len(out) + 1), b"\xff" * rng.randint(1, 9))  # undecodable, mid-stream
            why = "message.undecodable"
        return out, why, rng.random() < 0.1

    def _admin(self, method: str) -> tuple[list[bytes], str | None, bool]:
        rng = self.rng
        if method in ("Status", "GetPlan"):
            return [b""], None, False
        if method == "Events":
            e = pb.EventsRequest(after_seq=rng.randrange(10 ** 4), limit=rng.randrange(200))
            why = self.pick({"after_seq<0": lambda: setattr(e, "after_seq", -1),
                             "limit": lambda: setattr(e, "limit", rng.choice((10001, 2 ** 32 - 1)))})
            return [e.SerializeToString()], why, False
        if method == "Inject":
            i = pb.InjectRequest(kind=rng.choice(("slow", "kill")), rank=self.rank(), factor=rng.uniform(1, 4))
            why = self.pick({"kind": lambda: setattr(i, "kind", rng.choice(("", "melt", "SLOW", "kill\x00"))),
                             "rank": lambda: setattr(i, "rank", self.bad_rank()),
                             "factor": lambda: _set(i, kind="slow", factor=rng.choice(
                                 (math.nan, math.inf, -math.inf, 0.5, -2.0, 1e6)))})
            return [i.SerializeToString()], why, False
        if method in ("Exclude", "Readmit"):
            r = pb.RankRequest(rank=self.rank(), reason=self.text())
            why = self.pick({"rank": lambda: setattr(r, "rank", self.bad_rank()),
                             "reason-long": lambda: setattr(r, "reason", self.text(long=True))})
            return [r.SerializeToString()], why, False
        if method == "Policy":
            p = pb.PolicyRequest(set=rng.choice(({}, {"auto_reconfigure": rng.choice(("on", "off"))},
                                                 {"heartbeat_timeout_s": "5"})))
            why = self.pick({
                "unknown-key": lambda: p.set.update({self.text() + "?": "1"}),
                "on-off": lambda: p.set.update({"plan_audit": rng.choice(("yes", "", "ON"))}),
                "number": lambda: p.set.update({rng.choice(("ack_timeout_s", "heartbeat_timeout_s", "apply_margin")):
                                                rng.choice(("nan", "inf", "-1", "1e999", "x", ""))}),
                "too-many-keys": lambda: p.set.update({f"k{i}": "1" for i in range(65)})})
            return [p.SerializeToString()], why, False
        msg = (pb.ReplanRequest if method == "Replan" else pb.DrainRequest)(reason=self.text())
        why = self.pick({"reason-long": lambda: setattr(msg, "reason", self.text(True))})
        return [msg.SerializeToString()], why, False

    def raw(self, service: str, method: str) -> Case:
        """Bytes that need not parse: random, or a real request cut short or with a byte flipped."""
        rng = self.rng
        real = self._build(service, method)[0][0]
        roll = rng.random()
        if roll < 0.4 or not real:
            data, what = rng.randbytes(rng.randint(1, 64)), "raw.random"
        elif roll < 0.7:
            data, what = real[:rng.randrange(len(real))], "raw.truncated"
        else:
            i = rng.randrange(len(real))
            data, what = real[:i] + bytes([real[i] ^ (1 << rng.randrange(8))]) + real[i + 1:], "raw.bitflip"
        shape = SHAPES.get((service.rpartition(".")[2], method), "unary")
        return Case(service, method, shape, (data,), CLEAR, what)

    def _build(self, service: str, method: str) -> tuple[list[bytes], str | None, bool]:
        if service == HOOK:
            return self._hook(method)
        return self._coordinator(method) if service == COORD else self._admin(method)

    def case(self) -> Case:
        rng = self.rng
        service, method = rng.choice(self.methods)
        shape = SHAPES.get((service.rpartition(".")[2], method), "unary")
        writes = self.mutate_state or f"{service}/{method}" in READ_ONLY
        roll = rng.random()
        needs_token = self.t.hook_token if service == HOOK else self.t.coordinator_token
        if roll < 0.1 and needs_token:
            cred = rng.choice(("none", "wrong", "other-service", "no-bearer"))
            return Case(service, method, shape, tuple(self._build(service, method)[0]), DENIED, f"auth.{cred}", cred)
        if roll < 0.3:
            c = self.raw(service, method)
            if writes or not _parses(service, method, c.requests[0]):
                return c
        for _ in range(8):  # without valid writes, draw until the request is one the server must refuse
            reqs, why, cancel = self._build(service, method)
            if why is not None or writes:
                break
        else:
            return Case(service, method, shape, (b"\xff",), REFUSED, "raw.undecodable")
        if why is not None:
            return Case(service, method, shape, tuple(reqs), REFUSED, why, cancel=cancel)
        return Case(service, method, shape, tuple(reqs), CLEAR, "valid", cancel=cancel)


def _set(msg: Any, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(msg, name, value)


def _packed_append(pc: pb.PackedChunks, kind: str, start_s: float, end_s: float) -> None:
    """One more chunk in a report's packed arrays (all five stay the same length)."""
    pc.kinds = ",".join(filter(None, [pc.kinds, kind]))
    pc.microbatch.append(0)
    pc.chunk.append(0)
    pc.start_s.append(start_s)
    pc.end_s.append(end_s)


def _added(repeated: Any, item: Any) -> Any:
    """Append ``item`` to a repeated message field and return the stored copy (to poison in place)."""
    repeated.append(item)
    return repeated[-1]


def _parses(service: str, method: str, data: bytes) -> bool:
    try:
        REQUEST_TYPES[f"{service}/{method}"].FromString(data)
    except Exception:
        return False
    return True


_METHODS = {HOOK: ("Hello", "Report", "ReportStream", "Commands", "Acknowledge", "Leave"),
            COORD: ("Register", "Stream"),
            ADMIN: ("Status", "Events", "GetPlan", "Inject", "Exclude", "Readmit", "Policy", "Replan", "Drain")}
