"""Helpers for control-plane tests: real coordinator / agent / fake-trainer processes.

Everything binds port 0 and reads the bound address back from the files the daemons
write; waits are polls with deadlines, never bare sleeps; every child is ended and
joined with a timeout by ``Cluster.close``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from resihp.coordinator.protocol.auth import metadata
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
FAKE_TRAINER = str(REPO / "tests" / "fake_trainer.py")


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return out


@dataclass
class Cluster:
    run: Path
    token: str = "test-token-0123456789"
    world: int = 4
    tp: int = 1
    pp: int = 2
    engine: str = "auto"
    heartbeat_timeout_s: float = 1.5
    extra: Sequence[str] = ()
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    coord_addr: str = ""
    hooks: dict[str, str] = field(default_factory=dict)
    netns: dict[str, str] = field(default_factory=dict)  # node -> namespace for agents started in one

    def env(self) -> dict[str, str]:
        return {**os.environ, "RESIHP_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.run / f"{name}.out", "ab")
        proc = subprocess.Popen(cmd, env=env or self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
        self.procs[name] = proc
        return proc

    def start_coordinator(self, port: int = 0, host: str = "127.0.0.1") -> str:
        info = self.run / "coordinator.json"
        if info.exists():
            info.unlink()
        proc = self._spawn("coordinator", [
            PY, "-m", "resihp.cli", "coordinator", "--run-dir", str(self.run), "--job", "t", "-n", str(self.world),
            "--tp", str(self.tp), "--pp", str(self.pp), "--port", str(port), "--host", host,
            "--engine", self.engine, "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
            "--heartbeat-interval-s", "0.25", "--log-level", "WARNING", "--device-flops", "1e9", *self.extra])
        data = wait_until(lambda: proc.poll() is None and info.exists() and json.loads(info.read_text()), 30,
                          "coordinator.json") if proc.poll() is None else None
        if not data:
            raise AssertionError(f"coordinator exited early: {(self.run / 'coordinator.out').read_text()}")
        self.coord_addr = data["grpc"]
        return self.coord_addr

    def start_agent(self, node: str, coordinator: str | None = None, netns: str | None = None) -> str:
        info = self.run / f"agent-{node}.json"
        cmd = [PY, "-m", "resihp.cli", "agent", "--node", node, "--job", "t", "--coordinator",
               coordinator or self.coord_addr, "--run-dir", str(self.run), "--world-size", str(self.world),
               "--heartbeat-interval-s", "0.25", "--gpu-sampler", "nvml", "--log-level", "WARNING"]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
            self.netns[node] = netns
        self._spawn(f"agent-{node}", cmd)
        data = wait_until(lambda: info.exists() and json.loads(info.read_text()), 30, f"agent {node}")
        self.hooks[node] = data["hook"]
        return str(data["hook"])

    def start_trainer(self, name: str, ranks: Sequence[int], node: str, *args: str) -> subprocess.Popen[bytes]:
        cmd = [PY, FAKE_TRAINER, "--ranks", ",".join(map(str, ranks)), "--world", str(self.world), "--tp",
               str(self.tp), "--pp", str(self.pp), "--agent", self.hooks[node], "--job", "t",
               "--log", str(self.run / f"{name}.jsonl"), *args]
        if node in self.netns:
            cmd = ["ip", "netns", "exec", self.netns[node]] + cmd
        return self._spawn(name, cmd)

    def admin(self, token: str | None = None) -> pbg.AdminStub:
        return pbg.AdminStub(grpc.insecure_channel(self.coord_addr))

    def md(self, token: str | None = None) -> Sequence[tuple[str, str]]:
        return metadata(self.token if token is None else token)

    def status(self) -> pb.StatusReply:
        return self.admin().Status(pb.StatusRequest(), metadata=self.md(), timeout=5)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        evs = read_jsonl(self.run / "events.jsonl")
        return [e for e in evs if kind is None or e.get("event") == kind]

    def trainer_log(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.run / f"{name}.jsonl")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        t = time.time()
        self.procs[name].send_signal(sig)
        return t

    def close(self) -> dict[str, int]:
        """End every child (SIGTERM, then SIGKILL), join each with a timeout, return exit codes."""
        codes = {}
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            codes[name] = proc.returncode
        return codes


def rank_pid(run: Path, rank: int) -> int | None:
    """The pid of rank ``rank`` of the job whose run directory is ``run`` (its environment names
    both: RESIHP_RUN_DIR and Open MPI's rank), or None while it is not there."""
    import psutil

    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("RESIHP_RUN_DIR") == str(run) and env.get("OMPI_COMM_WORLD_RANK") == str(rank):
            return int(proc.pid)
    return None
