"""Every endpoint resihp starts for ranks asks for the ranks' credential and binds where asked:
the job's store (a real store process) and the agent's Hook service (a real agent process)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch.distributed as dist
from cp_helpers import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from resihp.agent.server import CommandRelay, HookServer
from resihp.coordinator.protocol.auth import RANK_TOKEN_ENV, metadata, rank_token
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg
from resihp.trainer_hooks.launch.env_rendezvous import site_env
from resihp.trainer_hooks.launch.ports import listeners, listening_on_all_interfaces, unauthenticated_probe
from resihp.trainer_hooks.launch.store_client import AuthStore, connect
from resihp.trainer_hooks.launch.store_server import MAGIC, NONCE_BYTES, StoreAuthError, encode
from resihp.trainer_hooks.reconfig.ulfm import StoreProcess
from resihp.trainer_hooks.reporting.agent_client import AgentClient

TOKEN = "job-token-for-tests"


@pytest.fixture(scope="module")
def store() -> Iterator[StoreProcess]:
    with StoreProcess(credential=rank_token(TOKEN)) as s:
        yield s


def _client(store: StoreProcess, timeout_s: float = 5.0) -> AuthStore:
    return connect(store.addr, timedelta(seconds=timeout_s), credential=store.credential)


# --- the store --------------------------------------------------------------------------------------------
def test_the_store_listens_on_the_given_address_only(store: StoreProcess) -> None:
    socks = listeners([store.proc.pid])
    assert [(x.host, x.port) for x in socks] == [("127.0.0.1", store.port)], socks
    assert listening_on_all_interfaces([store.proc.pid]) == []


def _raw(store: StoreProcess) -> socket.socket:
    return socket.create_connection((store.host, store.port), timeout=5)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_client_without_the_credential_can_neither_read_nor_write(store: StoreProcess) -> None:
    ok = _client(store)
    ok.set("plan/epoch3", b"secret-plan")
    # a wrong credential is refused at the handshake
    with pytest.raises(StoreAuthError, match="refused"):
        AuthStore(store.host, store.port, "not-the-credential", timedelta(seconds=5))
    with pytest.raises(StoreAuthError, match="no credential"):
        AuthStore(store.host, store.port, "", timedelta(seconds=5))
    # a raw client that skips the handshake and asks for the key, then tries to overwrite it
    with _raw(store) as sock:
        sock.sendall(encode([b"get", b"plan/epoch3", b"1000"]) + encode([b"set", b"plan/epoch3", b"evil"]) + b"\0" * 64)
        got = _read_all(sock)
    assert got.startswith(MAGIC) and b"secret-plan" not in got and got[len(MAGIC) + NONCE_BYTES:] == b"\x00"
    # torch's own TCPStore client (what an unmodified tool would use) gets nowhere either
    with pytest.raises((RuntimeError, ValueError)):
        t = dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=2))  # type: ignore[attr-defined]
        t.get("plan/epoch3")
    assert ok.get("plan/epoch3") == b"secret-plan" and ok.num_keys() >= 1  # untouched, still serving


def test_every_store_call_c10d_uses(store: StoreProcess) -> None:
    a, b = _client(store), _client(store)
    assert a.add("calls/n", 2) == 2 and b.add("calls/n", 3) == 5
    assert a.compare_set("calls/cas", "", "first") == b"first"
    assert b.compare_set("calls/cas", "wrong", "second") == b"first"
    assert b.compare_set("calls/cas", "first", "second") == b"second"
    a.append("calls/log", b"x")
    b.append("calls/log", b"y")
    assert a.get("calls/log") == b"xy"
    a.multi_set(["calls/m1", "calls/m2"], [b"1", "2"])
    assert b.multi_get(["calls/m1", "calls/m2"]) == [b"1", b"2"]
    assert a.check(["calls/m1"]) and not a.check(["calls/m1", "calls/none"])
    assert a.delete_key("calls/m1") and not a.delete_key("calls/m1")
    prefixed = dist.PrefixStore("resihp/epoch7", a)  # type: ignore[attr-defined]
    prefixed.set("k", "v")
    assert b.get("resihp/epoch7/k") == b"v"
    # blocking calls: a get that times out says so (is_peer_failure knows "wait timeout") ...
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        a.wait(["calls/never"], timedelta(milliseconds=200))
    assert time.monotonic() - started < 3
    # ... and one that another client satisfies returns
    setter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from datetime import timedelta
        from resihp.trainer_hooks.launch.store_client import connect
        c = connect({store.addr!r}, timedelta(seconds=10), credential={store.credential!r})
        time.sleep(0.3)
        c.set("calls/later", "here")
    """)])
    assert a.get("calls/later") == b"here"
    assert setter.wait(30) == 0


GLOO_WORKER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from resihp.trainer_hooks.reconfig.world import connect_store
    rank, world, addr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = connect_store(addr, 30)
    for epoch in (0, 1):  # a fresh prefix per epoch, as the runtime does
        dist.init_process_group("gloo", store=dist.PrefixStore(f"resihp/epoch{epoch}/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        sub = dist.new_group([0, 1])
        x = torch.ones(1) * (rank + 1)
        dist.all_reduce(x)
        assert x.item() == world * (world + 1) / 2, x
        if rank < 2:
            dist.all_reduce(x, group=sub)
        dist.barrier()
        dist.destroy_process_group()
    print("ok", rank)
""")


def test_gloo_groups_of_four_ranks_join_through_the_store(store: StoreProcess) -> None:
    env = {**os.environ, RANK_TOKEN_ENV: store.credential, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_WORKER, str(r), "4", store.addr], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(4)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs


def test_a_torchrun_script_env_rendezvous_joins_the_store(store: StoreProcess) -> None:
    """What `resihp launch --torchrun-compat` runs: init_process_group("gloo") from env://, with
    MASTER_ADDR:MASTER_PORT the job's store, through the rank shim's sitecustomize."""
    env = {**os.environ, RANK_TOKEN_ENV: store.credential, "RESIHP_STORE_ADDR": store.addr,
           "MASTER_ADDR": store.host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "RANK": "0", "WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.update(site_env(env))
    script = ("import torch.distributed as dist; dist.init_process_group('gloo'); "
              "dist.distributed_c10d._get_default_store().set('torchrun/ok', 'yes'); dist.destroy_process_group()")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _client(store).get("default_pg/0//torchrun/ok") == b"yes"  # c10d's prefixes for the default group
    assert site_env({**env, RANK_TOKEN_ENV: ""}) == {}  # no credential: torch's own handler is left alone


# --- the agent's Hook service ---------------------------------------------------------------------------
class _Spy:
    """A HookSink that records every call the hook server makes into the agent."""

    node, job = "n0", "job"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "coordinator_connected":
            return lambda: False
        return lambda *a, **k: self.calls.append(name)


def _every_rpc(stub: pbg.HookStub, md: tuple[tuple[str, str], ...]) -> list[grpc.StatusCode]:
    calls = [
        lambda: stub.Hello(pb.HookHello(rank=0, pid=os.getpid()), metadata=md, timeout=5),
        lambda: stub.Report(pb.HookReportBatch(heartbeats=[pb.RankHeartbeat(rank=0, time_s=1.0)]), metadata=md, timeout=5),
        lambda: stub.ReportStream(iter([pb.HookReportBatch(heartbeats=[pb.RankHeartbeat(rank=0, time_s=1.0)])]),
                                  metadata=md, timeout=5),
        lambda: next(iter(stub.Commands(pb.CommandsRequest(rank=0), metadata=md, timeout=5))),
        lambda: stub.Acknowledge(pb.Ack(rank=0, seq=1, time_s=1.0), metadata=md, timeout=5),
        lambda: stub.Leave(pb.Goodbye(rank=0, pid=os.getpid()), metadata=md, timeout=5),
    ]
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        codes.append(info.value.code())  # type: ignore[attr-defined]
    return codes


def test_every_hook_rpc_without_the_rank_credential_is_unauthenticated_and_changes_nothing() -> None:
    spy = _Spy()
    server = HookServer(spy, CommandRelay(), "127.0.0.1:0", job_token=TOKEN)  # type: ignore[arg-type]
    server.start()
    try:
        stub = pbg.HookStub(grpc.insecure_channel(server.address))
        for md in ((), tuple(metadata("wrong")), tuple(metadata(TOKEN))):  # the job token is not the ranks' credential
            assert set(_every_rpc(stub, md)) == {grpc.StatusCode.UNAUTHENTICATED}
        assert spy.calls == []
        good = tuple(metadata(rank_token(TOKEN)))
        assert stub.Hello(pb.HookHello(rank=0, pid=os.getpid()), metadata=good, timeout=5).node == "n0"
        assert spy.calls == ["check_rank", "hook_hello"]
    finally:
        server.stop()


def test_a_real_agent_refuses_hooks_without_the_credential_and_its_own_hooks_get_in(
        tmp_path: Path, store: StoreProcess) -> None:
    env = {**os.environ, "RESIHP_TOKEN": TOKEN}
    env.pop(RANK_TOKEN_ENV, None)
    agent = subprocess.Popen([sys.executable, "-m", "resihp.cli", "agent", "--node", "n0", "--job", "t",
                              "--coordinator", "127.0.0.1:1", "--run-dir", str(tmp_path), "--world-size", "2",
                              "--gpu-sampler", "off", "--log-level", "WARNING"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        info = tmp_path / "agent-n0.json"
        hook = wait_until(lambda: info.exists() and json.loads(info.read_text()).get("hook"), 60, "the agent's hook")
        assert listening_on_all_interfaces([agent.pid]) == []
        (tmp_path / "store.json").write_text(json.dumps({"addr": store.addr}))
        assert unauthenticated_probe(tmp_path) == {"agent-n0.Hello": "refused", "store": "refused"}
        ch = grpc.insecure_channel(hook)
        assert set(_every_rpc(pbg.HookStub(ch), ())) == {grpc.StatusCode.UNAUTHENTICATED}
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub declares no methods
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
        intruder = AgentClient(0, hook, credential="", connect_timeout_s=2, retry_s=0.1).start()
        rank = AgentClient(1, hook, 1, "t", credential=rank_token(TOKEN), connect_timeout_s=5).start()
        try:
            assert rank.connected.is_set() and not intruder.connected.is_set()
        finally:
            rank.close()
            intruder.close()
    finally:
        agent.terminate()
        assert agent.wait(30) is not None


# --- a whole job ------------------------------------------------------------------------------------------
def test_a_launched_job_serves_only_authenticated_callers_and_only_mpi_listens_on_every_interface(
        tmp_path: Path) -> None:
    """`resihp launch` of four torchrun-style ranks (their env:// joins the store through the rank
    shim; their hooks reach the agent with the exported credential): while they train, no
    resihp process and no rank listens on 0.0.0.0 / [::] (only Open MPI's prterun does), and
    a call without credentials on every endpoint is refused."""
    import signal

    import psutil
    from cp_helpers import read_jsonl

    run = tmp_path / "run"
    script = Path(__file__).with_name("mpi_scripts") / "torchrun_style.py"
    launch = subprocess.Popen([sys.executable, "-m", "resihp.cli", "launch", "-n", "4", "--gpu-sampler", "off",
                               "--run-dir", str(run), "--", sys.executable, str(script), str(run / "ranks.jsonl"),
                               "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (run / "ranks.jsonl").exists()
                   and sum(e["event"] == "init" for e in read_jsonl(run / "ranks.jsonl")) == 4, 180, "4 ranks in init")
        tree = [launch.pid] + [p.pid for p in psutil.Process(launch.pid).children(recursive=True)]
        wide = [x for x in listening_on_all_interfaces(tree) if x["name"] not in ("prterun", "prted")]
        assert wide == [], wide
        probe = unauthenticated_probe(run)
        assert set(probe) == {"coordinator.Register", "admin.Status", "agent-node0.Hello", "store"}, probe
        assert set(probe.values()) == {"refused"}, probe
        store_pid = json.loads((run / "store.json").read_text())["pid"]
        assert {x.host for x in listeners([store_pid])} == {"127.0.0.1"}
    finally:
        launch.send_signal(signal.SIGINT)
        out, _ = launch.communicate(timeout=90)
    assert launch.returncode is not None, out[-3000:]


def test_connections_that_never_authenticate_are_capped_and_the_store_keeps_serving() -> None:
    """A peer that opens many connections and says nothing holds at most MAX_PENDING_HANDSHAKES
    threads; the rest are closed at once, and a rank with the credential still gets in."""
    import socket as _socket

    from resihp.trainer_hooks.launch import store_server as ss
    from resihp.trainer_hooks.launch.store_client import AuthStore

    server = ss.StoreServer("127.0.0.1", 0, "k" * 64).start()
    idle = []
    try:
        for _ in range(ss.MAX_PENDING_HANDSHAKES + 40):
            idle.append(_socket.create_connection(("127.0.0.1", server.port)))
        closed = 0
        for c in idle:
            c.settimeout(5.0)
            try:
                if c.recv(1) == b"":
                    closed += 1
            except TimeoutError:
                pass  # held in its handshake: one of the capped pending ones
            if closed >= 40:
                break
        assert closed >= 40
        for c in idle:  # the capped ones give up; a ranked client gets in right after
            c.close()
        client = AuthStore("127.0.0.1", server.port, "k" * 64)
        client.set("x", "1")
        assert client.get("x") == b"1"
        client.close()
    finally:
        for c in idle:
            c.close()
        server.close()
