"""Token, validation and robustness of the coordinator, Admin and hook endpoints (real servers, loopback)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from resihp.agent.daemon import AgentConfig, AgentDaemon
from resihp.agent.sampler import ScriptedSampler
from resihp.coordinator.protocol.auth import AuthError, metadata, rank_token, read_token, write_token
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.server import CoordinatorServer
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoordinatorServer, AgentDaemon]]:
    run = tmp_path_factory.mktemp("sec")
    coord = CoordinatorServer(CoordinatorConfig(world_size=4, pp=2, run_dir=str(run), token=TOKEN, metrics_port=0))
    coord.start()
    agent = AgentDaemon(AgentConfig(node="n0", job="job", coordinator=coord.address, token=TOKEN, world_size=4),
                        sampler=ScriptedSampler(degraded=True, reason="test"))
    agent.start()
    yield coord, agent
    agent.stop()
    coord.stop()


def _code(fn: object, *args: object, **kw: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)  # type: ignore[operator]
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def test_wrong_or_missing_token_is_unauthenticated(servers: tuple[CoordinatorServer, AgentDaemon]) -> None:
    coord, _ = servers
    ch = grpc.insecure_channel(coord.address)
    admin, cstub = pbg.AdminStub(ch), pbg.CoordinatorStub(ch)
    for md in ((), metadata("wrong"), (("authorization", TOKEN),)):
        code, details = _code(admin.Status, pb.StatusRequest(), metadata=md, timeout=5)
        assert code is grpc.StatusCode.UNAUTHENTICATED and "token" in details
        code, _ = _code(admin.Exclude, pb.RankRequest(rank=1), metadata=md, timeout=5)
        assert code is grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(cstub.Register, pb.RegisterRequest(node="evil"), metadata=md, timeout=5)
        assert code is grpc.StatusCode.UNAUTHENTICATED
    assert admin.Status(pb.StatusRequest(), metadata=metadata(TOKEN), timeout=5).epoch == 0  # no plan changed
    # health and reflection are open and standard
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="resihp.v1.Admin"), timeout=5)  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub declares no methods
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    [resp] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))  # pyright: ignore[reportCallIssue]  # typeshed types this method as a bare "Incomplete"
    names = {s.name for s in resp.list_services_response.service}
    assert {"resihp.v1.Coordinator", "resihp.v1.Admin", "grpc.health.v1.Health"} <= names


def test_malformed_requests_are_refused_and_the_coordinator_keeps_serving(
        servers: tuple[CoordinatorServer, AgentDaemon]) -> None:
    coord, _ = servers
    ch = grpc.insecure_channel(coord.address)
    admin, cstub, md = pbg.AdminStub(ch), pbg.CoordinatorStub(ch), metadata(TOKEN)
    cases = [
        (admin.Inject, pb.InjectRequest(kind="melt", rank=0), "inject kind must be 'slow' or 'kill'"),
        (admin.Inject, pb.InjectRequest(kind="slow", rank=99, factor=2), "rank 99 is out of range; this job has ranks 0..3"),
        (admin.Inject, pb.InjectRequest(kind="slow", rank=1, factor=math.inf), "factor must be in [1, 1000]"),
        (admin.Exclude, pb.RankRequest(rank=-1), "rank -1 is out of range"),
        (admin.Events, pb.EventsRequest(limit=20000), "events.limit must be at most 10000"),
        (admin.Policy, pb.PolicyRequest(set={"nope": "1"}), "unknown policy key 'nope'"),
        (admin.Policy, pb.PolicyRequest(set={"heartbeat_timeout_s": "nan"}), "heartbeat_timeout_s must be a finite"),
        (cstub.Register, pb.RegisterRequest(), "register.node is empty"),
        (cstub.Register, pb.RegisterRequest(node="x", ranks=[pb.LocalRank(rank=12)]), "rank 12 is out of range"),
        (cstub.Register, pb.RegisterRequest(node="x", job="other"), "tried to join job"),
    ]
    for method, request, message in cases:
        code, details = _code(method, request, metadata=md, timeout=5)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details, (request, details)
    # a stream from an unknown agent, and a stream carrying a NaN step time
    code, details = _code(lambda: list(cstub.Stream(iter([pb.AgentMessage(agent_id="ghost")]), metadata=md, timeout=5)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "Register first" in details
    reg = cstub.Register(pb.RegisterRequest(node="probe", job="job"), metadata=md, timeout=5)
    bad = pb.AgentMessage(agent_id=reg.agent_id, reports=[pb.RankReport(rank=0, step_s=math.nan)])
    code, details = _code(lambda: list(cstub.Stream(iter([bad]), metadata=md, timeout=5)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "reports[0].step_s must be a finite number" in details
    assert admin.Status(pb.StatusRequest(), metadata=md, timeout=5).world_size == 4  # still serving


def test_hook_server_validates_and_keeps_serving(servers: tuple[CoordinatorServer, AgentDaemon]) -> None:
    _, agent = servers
    hook = pbg.HookStub(grpc.insecure_channel(agent.hook_server.address))
    cases = [
        (hook.Report, pb.HookReportBatch(reports=[pb.RankReport(rank=0, step_s=-1)]), "reports[0].step_s must be a finite"),
        (hook.Report, pb.HookReportBatch(reports=[pb.RankReport(rank=7, step_s=1)]), "rank 7 is out of range"),
        (hook.Hello, pb.HookHello(rank=0, pid=0), "hello.pid must be the trainer's process id"),
        (hook.Hello, pb.HookHello(rank=0, pid=1, job="other"), "does not match this agent's job"),
        (hook.Acknowledge, pb.Ack(rank=0, seq=1, time_s=-5), "ack.time_s must be a finite number"),
    ]
    md = metadata(rank_token(TOKEN))  # the ranks' credential (resihp launch exports it as $RESIHP_RANK_TOKEN)
    for method, request, message in cases:
        code, details = _code(method, request, metadata=md, timeout=5)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details, details
    assert hook.Hello(pb.HookHello(rank=0, pid=1), metadata=md, timeout=5).node == "n0"
    code, _ = _code(hook.Hello, pb.HookHello(rank=0, pid=1), timeout=5)  # without it: refused
    assert code is grpc.StatusCode.UNAUTHENTICATED


def test_token_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "run" / "token"
    write_token(path, "abc")
    assert path.stat().st_mode & 0o777 == 0o600 and read_token(path) == "abc"
    path.chmod(0o644)
    with pytest.raises(AuthError, match="readable by others"):
        read_token(path)


def test_admin_cli_tables_json_and_clear_errors(servers: tuple[CoordinatorServer, AgentDaemon], tmp_path: Path) -> None:
    coord, _ = servers
    base = [sys.executable, "-m", "resihp.cli", "admin"]

    def run(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
        return subprocess.run(base + list(args) + ["--token", token], capture_output=True, text=True, timeout=60)

    ok = run("status", "--coordinator", coord.address)
    assert ok.returncode == 0 and "RANK" in ok.stdout and "RUNNING" in ok.stdout, ok.stderr
    header = next(line for line in ok.stdout.splitlines() if line.startswith("RANK"))
    assert header.split() == ["RANK", "NODE", "ROLE", "STATE", "ITER", "STEP_S", "SPEED", "PROBE", "SEEN_S_AGO"]
    st = json.loads(run("status", "--json", "--coordinator", coord.address).stdout)
    assert {r["role"] for r in st["ranks"]} == {"member"} and all(r["probe_ratio"] == 0.0 for r in st["ranks"])
    as_json = run("plan", "--json", "--coordinator", coord.address)
    assert as_json.returncode == 0 and '"replicas"' in as_json.stdout
    refused = run("status", "--coordinator", coord.address, token="bad")
    assert refused.returncode == 4 and "refused the token" in refused.stderr
    invalid = run("exclude", "--rank", "40", "--coordinator", coord.address)
    assert invalid.returncode == 5 and "rank 40 is out of range" in invalid.stderr
    gone = run("status", "--coordinator", "127.0.0.1:1", "--timeout", "1")
    assert gone.returncode == 3 and "cannot reach the coordinator at 127.0.0.1:1" in gone.stderr


def test_metrics_endpoint_serves_prometheus_text(servers: tuple[CoordinatorServer, AgentDaemon]) -> None:
    import urllib.request

    coord, agent = servers
    assert coord.metrics is not None
    deadline_ok = False
    for _ in range(100):  # the agent's first heartbeat carries the degraded sampler flag
        text = urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics.port}/metrics", timeout=5).read().decode()
        if 'resihp_agent_sampler_degraded{job="job",node="n0"} 1' in text:
            deadline_ok = True
            break
        agent.stopped.wait(0.05)
    assert deadline_ok, text
    import re

    assert '# TYPE resihp_state gauge' in text and '# TYPE resihp_findings_total counter' in text
    assert len(re.findall(r'^resihp_state\{job="job",state="[A-Z]+"\} 1$', text, re.M)) == 1  # one-hot


def test_tls_with_certificate_flags(tmp_path: Path) -> None:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    coord = CoordinatorServer(CoordinatorConfig(world_size=2, run_dir=str(tmp_path / "run"), token=TOKEN,
                                                metrics_port=-1, tls_cert=str(cert), tls_key=str(key)))
    coord.start()
    try:
        res = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "status", "--json", "--coordinator",
                              coord.address, "--token", TOKEN, "--tls-ca", str(cert)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and '"world_size": 2' in res.stdout, res.stderr
        plain = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "status", "--coordinator",
                                coord.address, "--token", TOKEN, "--timeout", "2"],
                               capture_output=True, text=True, timeout=60)
        assert plain.returncode == 3  # a plaintext client cannot talk to the TLS server
    finally:
        coord.stop()
