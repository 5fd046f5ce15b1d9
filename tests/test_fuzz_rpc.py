"""Hostile and malformed input on every RPC of the Hook, Coordinator and Admin services, against
real servers: each bad request gets a clear status with a message, never INTERNAL or UNKNOWN,
and the daemons keep serving (coordinator/fuzz)."""
from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cp_helpers import Cluster, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resihp.agent.daemon import AgentConfig, AgentDaemon
from resihp.agent.sampler import ScriptedSampler
from resihp.coordinator.fuzz import CaseGenerator, Target, fuzz_endpoints
from resihp.coordinator.fuzz.cases import ADMIN, COORD, HOOK, REQUEST_TYPES, SHAPES
from resihp.coordinator.fuzz.runner import NEVER, Watch, _Endpoint, alive, judge, send
from resihp.coordinator.protocol.auth import metadata, rank_token
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.server import CoordinatorServer, CoordinatorServicer
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

TOKEN = "fuzz-token-0123"
JOB = "fuzzjob"
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Daemons:
    def __init__(self, run: Path) -> None:
        self.coord = CoordinatorServer(CoordinatorConfig(world_size=4, pp=2, run_dir=str(run), token=TOKEN,
                                                         metrics_port=0, job=JOB))
        self.coord.start()
        self.agent = AgentDaemon(AgentConfig(node="n0", job=JOB, coordinator=self.coord.address, token=TOKEN,
                                             world_size=4), sampler=ScriptedSampler(degraded=True, reason="fuzz"))
        self.agent.start()
        self.hook = _Endpoint(self.agent.hook_server.address, rank_token(TOKEN), TOKEN)
        self.admin = _Endpoint(self.coord.address, TOKEN, rank_token(TOKEN))
        assert self.coord.metrics is not None
        self.metrics_url = f"http://127.0.0.1:{self.coord.metrics.port}/metrics"

    def endpoint(self, service: str) -> _Endpoint:
        return self.hook if service == HOOK else self.admin

    def assert_alive(self) -> None:
        assert alive(self.hook, (f"/{HOOK}/Report", b""), ()) is None
        assert alive(self.admin, (f"/{ADMIN}/Status", b""), ()) is None


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    d = Daemons(tmp_path_factory.mktemp("fuzz"))
    yield d
    d.agent.stop()
    d.coord.stop()


def _call(d: Daemons, service: str, method: str, requests: list[bytes]) -> tuple[str, str]:
    from resihp.coordinator.fuzz.cases import CLEAR, Case

    shape = SHAPES.get((service.rpartition(".")[2], method), "unary")
    return send(d.endpoint(service), Case(service, method, shape, tuple(requests), CLEAR, "test"))


# --- fixes, each with the case that found it -------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(REQUEST_TYPES))
def test_undecodable_bytes_are_invalid_argument_naming_the_method(daemons: Daemons, path: str) -> None:
    """gRPC answered INTERNAL (sync server) or UNKNOWN (asyncio) "Exception deserializing request"."""
    service, _, method = path.rpartition("/")
    status, details = _call(daemons, service, method, [b"\xff\xff\xff"])
    assert status == "INVALID_ARGUMENT", (status, details)
    assert f"{path} is not a valid message" in details


def test_an_undecodable_message_mid_stream_ends_the_stream_with_invalid_argument(daemons: Daemons) -> None:
    beat = pb.HookReportBatch(heartbeats=[pb.RankHeartbeat(rank=0, time_s=1.0)]).SerializeToString()
    status, details = _call(daemons, HOOK, "ReportStream", [beat, beat, b"\x0a\xff"])
    assert status == "INVALID_ARGUMENT" and "ReportStream is not a valid message" in details
    conn = _register(daemons, "fz-mid")
    good = pb.AgentMessage(agent_id=conn).SerializeToString()
    status, details = _call(daemons, COORD, "Stream", [good, b"\xff\x00"])
    assert status == "INVALID_ARGUMENT" and "Stream is not a valid message" in details, details
    daemons.assert_alive()


def _register(d: Daemons, node: str) -> str:
    stub = pbg.CoordinatorStub(grpc.insecure_channel(d.coord.address))
    return str(stub.Register(pb.RegisterRequest(node=node, job=JOB), metadata=metadata(TOKEN), timeout=5).agent_id)


def test_a_hello_with_a_negative_local_rank_is_refused_and_the_uplink_stays(daemons: Daemons) -> None:
    """The agent took it and forwarded it; the coordinator refused the agent's whole stream, and
    then its every re-registration while that rank lived: one hello cut the node off."""
    watch = Watch(daemons.admin, None)
    hello = pb.HookHello(rank=1, local_rank=-1, pid=(1 << 22) + 5, job=JOB)
    status, details = _call(daemons, HOOK, "Hello", [hello.SerializeToString()])
    assert status == "INVALID_ARGUMENT" and "hello.local_rank must be >= 0" in details
    assert watch.problems() == []
    assert daemons.agent.uplink.connected.wait(5)


class _Context:
    """A servicer context whose call is already cancelled (``active=False``) or live."""

    def __init__(self, active: bool) -> None:
        self.active, self.aborted = active, None

    def is_active(self) -> bool:
        return self.active

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)  # type: ignore[assignment]
        raise RuntimeError(details)


def test_a_stream_cancelled_before_its_loop_does_not_end_the_next_stream_of_its_agent(daemons: Daemons) -> None:
    """A burst found a poisoned agent message answered OK: an earlier stream of the same agent id,
    cancelled before its loop began, had left its reader's end mark in the outbox, and the next
    stream took it for its own and ended before its reader had judged the message."""
    core = daemons.coord.core
    servicer = CoordinatorServicer(core)
    aid = _register(daemons, "fz-cancel")
    conn = core.agents[aid]
    assert list(servicer.Stream(iter([pb.AgentMessage(agent_id=aid)]), _Context(active=False))) == []  # type: ignore[arg-type]
    wait_until(lambda: conn.outbox.qsize() == 1, 5, "the cancelled stream's reader to finish")
    bad = pb.AgentMessage(agent_id=aid, probes=[pb.RankProbe(rank=0, time_s=1.0, probe_s=math.nan)])
    live = _Context(active=True)

    def messages() -> Iterator[pb.AgentMessage]:
        yield pb.AgentMessage(agent_id=aid)
        wait_until(lambda: conn.outbox.qsize() == 0, 5, "the new stream to take the old mark")
        yield bad  # as over a network: the bad message comes after the loop has looked at the outbox

    with pytest.raises(RuntimeError, match="probe_s"):
        list(servicer.Stream(messages(), live))  # type: ignore[arg-type]
    assert live.aborted is not None and live.aborted[0] is grpc.StatusCode.INVALID_ARGUMENT


# --- properties -----------------------------------------------------------------------------------------
@SLOW
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_every_seeded_case_gets_a_clear_answer(daemons: Daemons, seed: int) -> None:
    target = Target(world=4, job=JOB)
    case = CaseGenerator(random.Random(seed), target, mutate_state=True).case()
    status, details = send(daemons.endpoint(case.service), case)
    assert judge(case, status, details) is None


FLOATS = st.floats(allow_nan=True, allow_infinity=True)
INTS = st.integers(-(2 ** 31), 2 ** 31 - 1)


@SLOW
@given(rank=INTS, time_s=FLOATS, iteration=st.integers(-(2 ** 63), 2 ** 63 - 1), probe_s=FLOATS)
def test_hook_report_timings_are_checked(daemons: Daemons, rank: int, time_s: float, iteration: int,
                                         probe_s: float) -> None:
    batch = pb.HookReportBatch(heartbeats=[pb.RankHeartbeat(rank=rank, time_s=time_s, iteration=iteration)],
                               probes=[pb.RankProbe(rank=rank, time_s=abs(time_s), probe_s=probe_s)])
    status, details = _call(daemons, HOOK, "Report", [batch.SerializeToString()])
    good = (0 <= rank < 4 and math.isfinite(time_s) and time_s >= 0 and iteration >= -1
            and math.isfinite(probe_s) and probe_s > 0)
    assert status == ("OK" if good else "INVALID_ARGUMENT"), (status, details)
    assert good or details


@SLOW
@given(kind=st.sampled_from(["slow", "kill", "", "melt", "slow\x00"]), rank=INTS, factor=FLOATS)
def test_admin_inject_is_checked(daemons: Daemons, kind: str, rank: int, factor: float) -> None:
    req = pb.InjectRequest(kind=kind if kind != "kill" else "slow", rank=rank, factor=factor)
    status, details = _call(daemons, ADMIN, "Inject", [req.SerializeToString()])
    assert status in ("OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION"), (status, details)
    if not (0 <= rank < 4 and req.kind == "slow" and 1.0 <= factor <= 1000.0):
        assert status != "OK" and details


@SLOW
@given(path=st.sampled_from(sorted(REQUEST_TYPES)), data=st.binary(max_size=256))
def test_raw_bytes_on_every_method_never_break_a_server(daemons: Daemons, path: str, data: bytes) -> None:
    service, _, method = path.rpartition("/")
    if path in (f"/{ADMIN}/Drain",):  # empty bytes are a valid drain: keep the job running for the other tests
        data = data or b"\xff"
    status, details = _call(daemons, service, method, [data])
    assert status not in {c.name for c in NEVER} and status != "UNAVAILABLE", (status, details)


# --- bursts ---------------------------------------------------------------------------------------------
def test_cases_are_deterministic_from_the_seed() -> None:
    def draw() -> list[object]:
        gen = CaseGenerator(random.Random(42), Target(world=4, job=JOB, agent_ids=["a#1"]), mutate_state=True)
        return [gen.case() for _ in range(300)]

    assert draw() == draw()


def test_a_burst_of_1000_seeded_cases_gives_no_internal_error_and_no_crash(daemons: Daemons) -> None:
    threads = threading.active_count()
    result = fuzz_endpoints(daemons.coord.address, daemons.agent.hook_server.address, TOKEN, 1000, seed=1,
                            mutate_state=True, check_every=100, metrics_url=daemons.metrics_url)
    assert result.cases == 1000 and result.daemon_crashes == 0
    assert result.unexpected == []
    assert not {"INTERNAL", "UNKNOWN", "UNAVAILABLE"} & set(result.by_status)
    assert {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED"} <= set(result.by_status)
    daemons.assert_alive()
    # nothing left behind: command subscriptions, stream reader threads; the agent's own uplink is up
    wait_until(lambda: daemons.agent.relay.subscribers() == {}, 5, "the fuzzer's subscriptions to end")
    wait_until(lambda: threading.active_count() <= threads + 8, 10, "the streams' threads to end")
    assert daemons.agent.uplink.connected.is_set()


def test_without_valid_writes_a_live_job_is_left_alone(tmp_path: Path) -> None:
    d = Daemons(tmp_path)
    try:
        before = pbg.AdminStub(d.admin.channel).Status(pb.StatusRequest(), metadata=metadata(TOKEN), timeout=5)
        result = fuzz_endpoints(d.coord.address, d.agent.hook_server.address, TOKEN, 400, seed=2)
        assert result.unexpected == [] and result.daemon_crashes == 0
        after = pbg.AdminStub(d.admin.channel).Status(pb.StatusRequest(), metadata=metadata(TOKEN), timeout=5)
        assert (after.state, after.epoch, after.policy) == (before.state, before.epoch, before.policy)
        assert d.agent.locals == {}  # no hello got in
        assert "OK" not in result.by_status or result.by_kind.get("valid", 0) >= result.by_status["OK"]
    finally:
        d.agent.stop()
        d.coord.stop()


def test_daemon_processes_survive_a_burst(tmp_path: Path) -> None:
    """The coordinator and agent as the launcher starts them: separate processes."""
    cluster = Cluster(tmp_path, token=TOKEN)
    try:
        cluster.start_coordinator()
        hook = cluster.start_agent("n0")
        pids = {name: p.pid for name, p in cluster.procs.items()}
        result = fuzz_endpoints(cluster.coord_addr, hook, TOKEN, 600, seed=3, mutate_state=True, check_every=100,
                                coordinator_pids=[pids["coordinator"]], agent_pids=[pids["agent-n0"]])
        assert result.unexpected == [] and result.daemon_crashes == 0, result.unexpected[:5]
        assert all(p.poll() is None for p in cluster.procs.values())
    finally:
        codes = cluster.close()
    assert set(codes) == {"coordinator", "agent-n0"}


def test_an_asyncio_stream_both_ways_answers_invalid_argument_at_the_undecodable_message() -> None:
    """decode_guard's asyncio wrapper for a stream in both directions (none of resihp's asyncio
    services has one today; the Coordinator's Stream, served here on an asyncio server, has):
    the good message before the bad one is answered, then the call ends INVALID_ARGUMENT."""
    import asyncio

    import grpc
    import grpc.aio

    from resihp.coordinator.protocol.decode_guard import add_servicer
    from resihp.proto import resihp_pb2 as pb
    from resihp.proto import resihp_pb2_grpc as pbg

    class Echo(pbg.CoordinatorServicer):
        async def Stream(self, request_iterator, context):  # type: ignore[no-untyped-def,override]
            async for _ in request_iterator:
                yield pb.CoordinatorMessage()

    async def run() -> tuple[int, grpc.StatusCode, str]:
        server = grpc.aio.server()
        add_servicer(pbg.add_CoordinatorServicer_to_server, Echo(), server, aio=True)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
                call = chan.stream_stream("/resihp.v1.Coordinator/Stream", request_serializer=None,
                                          response_deserializer=None)(
                    iter([pb.AgentMessage(node="n0").SerializeToString(), b"\xff\xff\xff"]))
                got = 0
                try:
                    async for _ in call:
                        got += 1
                except grpc.aio.AioRpcError as exc:
                    return got, exc.code(), exc.details() or ""
                return got, grpc.StatusCode.OK, ""
        finally:
            await server.stop(None)

    got, code, details = asyncio.run(run())
    assert got == 1 and code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Coordinator/Stream is not a valid message" in details
