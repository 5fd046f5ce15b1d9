"""The coordinator's gRPC face: Coordinator (agents) and Admin (operators) services.

Thin: every call is decoded by ``codec``, handed to ``CoordinatorCore`` and answered;
``ValidationError`` becomes INVALID_ARGUMENT, ``Refused`` FAILED_PRECONDITION, and no
exception escapes a handler. Every server also carries the standard health service and
server reflection; the token interceptor guards everything else.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset
from resihp.coordinator.protocol import codec, wire
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.auth import TokenInterceptor, server_credentials
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.protocol.decode_guard import add_servicer
from resihp.coordinator.service.admin import SERVICE_ONLY_POLICY, Refused
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.core import CoordinatorCore, TraceSink
from resihp.coordinator.service.engine import Engine, build_header, make_engine
from resihp.coordinator.service.journal import Journal
from resihp.coordinator.service.metrics import MetricsServer, Registry, describe_standard
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 2**20
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_ping_interval_without_data_ms", 5000)]


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map our exceptions to status codes; never let one kill the server thread."""

    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except ValidationError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except grpc.RpcError:
            raise
        except Exception as exc:  # a bug must cost one request, not the daemon
            if type(exc).__name__ == "_AbortError" or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed: {type(exc).__name__}: {exc}")

    wrapper.__name__ = fn.__name__
    return wrapper


class CoordinatorServicer(pbg.CoordinatorServicer):
    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core

    @guarded
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        _, welcome = self.core.register(codec.registration_from_pb(request))
        return codec.welcome_to_pb(welcome)

    def Stream(self, request_iterator: Iterator[pb.AgentMessage], context: grpc.ServicerContext
               ) -> Iterator[pb.CoordinatorMessage]:
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        try:
            conn = self.core.agent(first.agent_id)
        except Refused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.core.stream_opened(conn)
        failure: list[str] = []
        # this stream's own end mark: a stream cancelled before its loop began leaves its reader's
        # mark in the agent's outbox, and that must not end the next stream of the same agent id
        end = m.CoordinatorBatch()

        def apply(msg: pb.AgentMessage) -> None:
            self.core.on_batch(conn, wire.agent_batch_from_wire(msg))

        def reader() -> None:
            try:
                apply(first)
                for msg in request_iterator:
                    apply(msg)
                failure.append("agent closed the stream")
            except ValidationError as exc:
                failure.append(f"invalid agent message: {exc}")
                self.core.metrics.inc("resihp_requests_invalid_total", 1, {"job": self.core.config.job, "kind": "stream"})
            except Exception as exc:  # stream broken (agent gone) or a bug
                failure.append(f"stream ended: {type(exc).__name__}: {exc}")
            conn.outbox.put(end)

        t = threading.Thread(target=reader, name=f"agent-{conn.node}", daemon=True)
        t.start()
        try:
            while context.is_active():
                try:
                    item = conn.outbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None or item is end:
                    break
                if not (item.commands or item.kills):
                    continue  # an earlier stream's end mark
                yield codec.coordinator_batch_to_pb(item)
        finally:
            why = failure[0] if failure else "stream cancelled"
            self.core.stream_closed(conn, why)
        if failure and failure[0].startswith("invalid"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, failure[0])


class AdminServicer(pbg.AdminServicer):
    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core

    @guarded
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        st = self.core.admin.status()
        return pb.StatusReply(
            job=st["job"], state=st["state"], state_reason=st["state_reason"], epoch=st["epoch"],
            iteration=st["iteration"], world_size=st["world_size"], agents_connected=st["agents_connected"],
            engine=st["engine"], policy=st["policy"], uptime_s=st["uptime_s"],
            planner_profile=st["planner_profile"], ranks=[pb.RankStatus(**r) for r in st["ranks"]],
            observe_only=st["observe_only"], model=st["model"],
        )

    @guarded
    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> pb.EventsReply:
        limit = request.limit or 100
        if limit > 10000:
            raise ValidationError(f"events.limit must be at most 10000, got {limit}")
        if request.after_seq < 0:
            raise ValidationError(f"events.after_seq must be >= 0, got {request.after_seq}")
        events = self.core.events.since(request.after_seq, limit)
        return pb.EventsReply(events_json=[json.dumps(e, default=str) for e in events])

    @guarded
    def GetPlan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanReply:
        with self.core.lock:
            return pb.PlanReply(epoch=self.core.plan.epoch, plan_json=codec.plan_to_json(self.core.plan))

    @guarded
    def Inject(self, request: pb.InjectRequest, context: grpc.ServicerContext) -> pb.AdminReply:
        msg = self.core.admin.inject(request.kind, request.rank, request.factor if request.kind == "slow" else 1.0)
        return pb.AdminReply(ok=True, message=msg, epoch=self.core.epoch, seq=self.core.seq)

    @guarded
    def Exclude(self, request: pb.RankRequest, context: grpc.ServicerContext) -> pb.AdminReply:
        msg = self.core.admin.exclude(request.rank, codec._text(request.reason, "reason"))
        return pb.AdminReply(ok=True, message=msg, epoch=self.core.epoch, seq=self.core.seq)

    @guarded
    def Readmit(self, request: pb.RankRequest, context: grpc.ServicerContext) -> pb.AdminReply:
        msg = self.core.admin.readmit(request.rank, codec._text(request.reason, "reason"))
        return pb.AdminReply(ok=True, message=msg, epoch=self.core.epoch, seq=self.core.seq)

    @guarded
    def Policy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.PolicyReply:
        if len(request.set) > 64:
            raise ValidationError(f"policy: at most 64 keys per request, got {len(request.set)}")
        return pb.PolicyReply(policy=self.core.admin.set_policy(dict(request.set)))

    @guarded
    def Replan(self, request: pb.ReplanRequest, context: grpc.ServicerContext) -> pb.AdminReply:
        msg = self.core.admin.replan(codec._text(request.reason, "reason"))
        return pb.AdminReply(ok=True, message=msg, epoch=self.core.epoch, seq=self.core.seq)

    @guarded
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.AdminReply:
        msg = self.core.admin.drain(codec._text(request.reason, "reason"))
        return pb.AdminReply(ok=True, message=msg, epoch=self.core.epoch, seq=self.core.seq)


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in service_names + [""]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


def load_model(name: str) -> ModelSpec:
    if os.path.exists(name):
        import yaml

        return ModelSpec.from_dict(yaml.safe_load(Path(name).read_text()))
    return preset(name)


def planner_links(cfg: CoordinatorConfig) -> dict[str, float]:
    """Link speeds and device FLOP/s for the planner's Cluster, from --cluster and --device-flops."""
    links: dict[str, float] = {}
    if cfg.cluster_file:
        from resihp.coordinator.model.cluster import Cluster

        c = Cluster.from_dict(json.loads(Path(cfg.cluster_file).read_text()))
        links = {k: float(getattr(c, k)) for k in ("intra_node_bw_Bps", "inter_node_bw_Bps", "intra_node_latency_s",
                                                      "inter_node_latency_s", "device_flops")}
    if cfg.device_flops > 0:
        links["device_flops"] = cfg.device_flops
    return links


def initial_plan(cfg: CoordinatorConfig, model: ModelSpec) -> Plan:
    if cfg.plan_file:
        plan = Plan.from_dict(json.loads(Path(cfg.plan_file).read_text()))
    else:
        mbs = cfg.microbatches or 2 * cfg.dp
        plan = Plan.uniform(cfg.tp, cfg.pp, cfg.dp, model.num_layers, mbs)
    plan.validate_for(model.num_layers, model.num_heads)
    bad = [r for r in plan.ranks() if r >= cfg.world_size]
    if bad:
        raise SpecError(f"plan uses ranks {bad} but world_size is {cfg.world_size}")
    return plan


class CoordinatorServer:
    """Build, start and stop the whole coordinator process (minus signal handling)."""

    def __init__(self, cfg: CoordinatorConfig, engine: Engine | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        run = cfg.run_path
        run.mkdir(parents=True, exist_ok=True)
        model = load_model(cfg.model)
        plan = initial_plan(cfg, model)
        self.registry = Registry()
        describe_standard(self.registry)
        journal = Journal(run / "journal.jsonl")
        earlier = journal.load().job
        if earlier and cfg.job and earlier != cfg.job:  # a restart resumes its own job, never another
            raise ValueError(f"{run / 'journal.jsonl'} is the journal of job {earlier}, not of job {cfg.job}: a "
                             f"coordinator resumes only its own job; give job {cfg.job} a run directory of its own "
                             f"(`resihp launch` sets an earlier job's files aside in previous/ itself)")
        # the header keeps the job's original layout (its DP degree is what readmission restores);
        # a restarted core hands the journaled plan to the engine itself
        nodes = dict(enumerate(cfg.rank_nodes.split(","))) if cfg.rank_nodes else None
        header = build_header(model, plan, cfg.world_size, cfg.job, cfg.tokens_per_microbatch, nodes)
        self.engine = engine or make_engine(cfg.engine, header,
                                            {"heartbeat_timeout_s": str(cfg.heartbeat_timeout_s),
                                             **{k: v for k, v in cfg.policy.items() if k not in SERVICE_ONLY_POLICY}},
                                            planner_links(cfg))
        # a restarted coordinator relearns its planner profile first: the core's clock of rank
        # silences starts when it is built
        warm = self._warm_start(run / "trace.jsonl") if journal.resuming() else None
        self.core = CoordinatorCore(cfg, plan, self.engine, journal, run / "events.jsonl", self.registry, clock)
        if warm is not None:
            self.core.events.emit("engine-warm-start", healthy_iterations=warm,
                                  reason=f"{warm} healthy iterations of trace.jsonl replayed; planner profile: "
                                         f"{self.engine.profile_text()}")
        self.core.trace = TraceSink(run / "trace.jsonl", header, append=self.core.resumed)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="coord"),
                                  interceptors=[TokenInterceptor(cfg.token)] if cfg.token else [],
                                  options=SERVER_OPTIONS)
        add_servicer(pbg.add_CoordinatorServicer_to_server, CoordinatorServicer(self.core), self.server)
        add_servicer(pbg.add_AdminServicer_to_server, AdminServicer(self.core), self.server)
        self.health = add_health_and_reflection(
            self.server, [pb.DESCRIPTOR.services_by_name[n].full_name for n in ("Coordinator", "Admin")])
        creds = server_credentials(cfg.tls_cert or None, cfg.tls_key or None)
        addr = f"{cfg.host}:{cfg.port}"
        self.port = self.server.add_secure_port(addr, creds) if creds else self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"could not bind the coordinator to {addr}")
        self.metrics: MetricsServer | None = None
        if cfg.metrics_port >= 0:
            self.metrics = MetricsServer(self.registry, cfg.metrics_host, cfg.metrics_port)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="coord-tick", daemon=True)

    @property
    def address(self) -> str:
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{host}:{self.port}"

    def _warm_start(self, trace: Path) -> int | None:
        """The planner's measured profile relearnt from the job's trace (None: not readable)."""
        try:
            with trace.open(encoding="utf-8") as fh:
                return self.engine.warm_start(fh)
        except OSError as exc:
            log.warning("could not read %s for the planner profile: %s", trace, exc)
            return None

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.cfg.tick_s):
            try:
                self.core.tick()
            except Exception:
                log.exception("tick failed")

    def start(self) -> None:
        if self.cfg.nice:
            os.nice(self.cfg.nice)  # the whole process (gRPC's threads included): yield to training ranks
        self.server.start()
        if self.metrics is not None:
            self.metrics.start()
        self._ticker.start()
        info = {"grpc": self.address, "pid": os.getpid(), "job": self.cfg.job,
                "metrics": f"http://{self.cfg.metrics_host}:{self.metrics.port}/metrics" if self.metrics else ""}
        tmp = self.cfg.run_path / "coordinator.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(self.cfg.run_path / "coordinator.json")  # atomic: readers never see half a file
        log.info("coordinator of job %s serving on %s (engine %s)", self.cfg.job, self.address, self.engine.name)

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        with self.core.lock:
            for conn in self.core.agents.values():
                conn.outbox.put(None)
        self.server.stop(grace_s).wait(grace_s + 1)
        if self.metrics is not None:
            self.metrics.stop()
        self.core.journal.close()
        self.core.events.close()

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self.server.wait_for_termination(timeout))


def status_json(core: CoordinatorCore) -> dict[str, Any]:
    return core.admin.status()


__all__ = ["CoordinatorServer", "CoordinatorServicer", "AdminServicer", "add_health_and_reflection", "m"]
