"""The ports a job listens on, and whether they let in a caller without credentials.

resihp's own daemons bind where they are asked and ask every caller for a credential
(docs/control-plane.md, "Security"); Open MPI's runtime listens on every interface whatever
it is told. A chaos benchmark or a test checks a live job with:

- ``listening_on_all_interfaces(pids)``: the sockets of ``pids`` bound to 0.0.0.0 or [::];
- ``unauthenticated_probe(run_dir)``: one call without credentials on every endpoint the run
  directory names (coordinator, Admin, each agent's Hook service, the job's store), each
  ``"refused"``, ``"accepted"`` or ``"unreachable"``.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # the process name, e.g. "python3", "prterun"
    host: str
    port: int


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state held by one of ``pids`` (gone processes are skipped)."""
    import psutil

    out: list[Listener] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                out.append(Listener(pid, name, str(c.laddr.ip), int(c.laddr.port)))
    return sorted(out, key=lambda x: (x.pid, x.port, x.host))


def listening_on_all_interfaces(pids: Iterable[int]) -> list[dict[str, Any]]:
    """The listening sockets of ``pids`` bound to a wildcard address (0.0.0.0 or [::]), reachable
    from every network the machine is on, as JSON-ready dicts (pid, name, host, port)."""
    return [asdict(x) for x in listeners(pids) if x.host in WILDCARDS]


def _grpc_verdict(call: Any) -> str:
    import grpc

    try:
        call()
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return "refused"
        return "unreachable" if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "accepted"
    return "accepted"


def _store_verdict(addr: str) -> str:
    from resihp.trainer_hooks.launch.store_server import StoreAuthError, client_handshake

    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
            client_handshake(sock, b"not-the-credential")
    except StoreAuthError:
        return "refused"
    except (OSError, ValueError):
        return "unreachable"
    return "accepted"


def unauthenticated_probe(run_dir: Path | str, timeout_s: float = 5.0) -> dict[str, str]:
    """One call without credentials on every endpoint of the job in ``run_dir`` (its
    coordinator.json, agent-*.json and store.json): endpoint -> refused | accepted | unreachable."""
    import grpc

    from resihp.proto import resihp_pb2 as pb
    from resihp.proto import resihp_pb2_grpc as pbg

    run = Path(run_dir)
    out: dict[str, str] = {}
    coord = run / "coordinator.json"
    if coord.exists():
        with grpc.insecure_channel(json.loads(coord.read_text())["grpc"]) as ch:
            out["coordinator.Register"] = _grpc_verdict(lambda: pbg.CoordinatorStub(ch).Register(
                pb.RegisterRequest(node="probe"), timeout=timeout_s))
            out["admin.Status"] = _grpc_verdict(lambda: pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=timeout_s))
    for info in sorted(run.glob("agent-*.json")):
        hook = json.loads(info.read_text()).get("hook")
        if hook:
            with grpc.insecure_channel(hook) as ch:
                out[f"{info.stem}.Hello"] = _grpc_verdict(lambda: pbg.HookStub(ch).Hello(
                    pb.HookHello(rank=0, pid=1), timeout=timeout_s))
    store = run / "store.json"
    if store.exists():
        out["store"] = _store_verdict(json.loads(store.read_text())["addr"])
    return out
