"""Control-plane benchmark: detection latency, command fan-out, hook cost, daemon footprints.

    python bench/control_plane.py [--quick]

Measures, on loopback:
- report_to_finding_ms p50/p99: from the last report() of the iteration that confirms a
  slowdown to the coordinator raising the finding (real hooks → real agent → real
  coordinator with the real detector; repeated slow/recover episodes);
- command_fanout_ms p50/p99: from issuing a command to the last of 64 hooks (over 8
  agent processes) receiving it;
- hook_report_us_p50: the cost of one report() call inside the trainer;
- agent_cpu_percent / agent_rss_mb: an agent process sampling at 1 Hz and relaying 8
  ranks at 10 iterations/s;
- coordinator_cpu_percent_1024: a coordinator process joining and judging 1,024 ranks
  at 1 iteration/s (eight emulated agent streams of 128 ranks, with chunk timings).
Prints a table, then ONE line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.auth import metadata, rank_token
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.server import CoordinatorServer
from resihp.proto import resihp_pb2 as pb
from resihp.proto import resihp_pb2_grpc as pbg
from resihp.trainer_hooks.reporting.agent_client import AgentClient

TOKEN = "bench-token"
PY = sys.executable


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


def start_agent(run: Path, node: str, coord: str, world: int, extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "RESIHP_TOKEN": TOKEN}
    proc = subprocess.Popen([PY, "-m", "resihp.cli", "agent", "--node", node, "--job", "bench", "--coordinator", coord,
                             "--run-dir", str(run), "--world-size", str(world), "--log-level", "WARNING",
                             *(extra or [])], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = run / f"agent-{node}.json"
    data = wait(lambda: info.exists() and json.loads(info.read_text()), 60, f"agent {node}")
    return proc, str(data["hook"])


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def chunks_for(rank: int, mbs: int, f_s: float) -> list[ChunkTiming]:
    out, t = [], 0.0
    for mb in range(mbs):
        out.append(ChunkTiming(rank, "F", mb, 0, t, t + f_s))
        out.append(ChunkTiming(rank, "B", mb, 0, t + f_s, t + 3 * f_s))
        t += 3 * f_s
    return out


# --- 1. report → finding -------------------------------------------------------------------
def bench_report_to_finding(run: Path, episodes: int) -> list[float]:
    cfg = CoordinatorConfig(world_size=8, tp=2, pp=2, run_dir=str(run), token=TOKEN, auto_reconfigure=False,
                            metrics_port=-1, job="bench", join_grace_s=1.0)
    server = CoordinatorServer(cfg)
    server.start()
    found: dict[int, float] = {}

    def listener(kind: str, payload: Any) -> None:
        if kind == "finding" and payload.kind == "fail-slow":
            found[payload.iteration] = time.perf_counter()

    server.core.listeners.append(listener)
    agent, hook = start_agent(run, "n0", server.address, 8)
    # default flush policy, as trainers get it: the ranks' step_s stays the same while rank 5
    # is slow (only its chunk timings grow), so no early flush helps — the worst case
    clients = [AgentClient(r, hook, r, "bench", reshapes=True, credential=rank_token(TOKEN)).start() for r in range(8)]
    last_report: dict[int, float] = {}
    latencies: list[float] = []
    try:
        it = 0
        seq = [[700, 324], [512, 512]]
        plan = server.core.plan
        warm = 12
        for ep in range(episodes + 1):
            slow_iters = range(0, 4) if ep > 0 else range(0)
            for k in range(warm if ep == 0 else 14):
                slow = k in slow_iters
                for c in clients:
                    factor = 3.0 if slow and c.rank == 5 else 1.0
                    mbs = plan.replicas[plan.position(c.rank).replica].microbatches
                    c.report(it, 0.02, time.time() - 0.02, seq[:mbs], chunks_for(c.rank, mbs, 0.002 * factor))
                last_report[it] = time.perf_counter()
                it += 1
                time.sleep(0.03)
        deadline = time.monotonic() + 5
        while len(found) < episodes and time.monotonic() < deadline:
            time.sleep(0.02)
        for iteration, t in found.items():
            if iteration in last_report:
                latencies.append((t - last_report[iteration]) * 1000)
    finally:
        for c in clients:
            c.close()
        stop([agent])
        server.stop()
    return latencies


# --- 2. command fan-out, 3. hook cost ---------------------------------------------------------
def bench_fanout(run: Path, commands: int) -> tuple[list[float], list[float]]:
    cfg = CoordinatorConfig(world_size=64, tp=2, pp=4, run_dir=str(run), token=TOKEN, auto_reconfigure=False,
                            metrics_port=-1, job="bench", model="llama2-7b")
    server = CoordinatorServer(cfg)
    server.start()
    procs, hooks = [], []
    for k in range(8):
        p, h = start_agent(run, f"n{k}", server.address, 64, ["--heartbeat-interval-s", "0.5"])
        procs.append(p)
        hooks.append(h)
    got: dict[int, list[float]] = {}
    lock = threading.Lock()
    done = threading.Event()

    def on_command(cmd: m.Command) -> None:
        now = time.perf_counter()
        with lock:
            got.setdefault(cmd.seq, []).append(now)
            if len(got[cmd.seq]) == 64:
                done.set()

    clients = [AgentClient(r, hooks[r // 8], r % 8, "bench", on_command=on_command, reshapes=True,
                           credential=rank_token(TOKEN)).start() for r in range(64)]
    fanout: list[float] = []
    hook_us: list[float] = []
    try:
        wait(lambda: sum(len(c.ranks) for c in server.core.agents.values()) == 64, 30, "64 ranks registered")
        time.sleep(0.5)  # command subscriptions open
        for _ in range(commands):
            done.clear()
            with server.core.lock:
                server.core.seq += 1
                seq = server.core.seq
                cmd = m.ThrottleCommand(server.core.epoch, 1.0, 0, "bench fan-out", seq, (), time.time())
                t0 = time.perf_counter()
                server.core._send_all(m.CoordinatorBatch(commands=(cmd,)))
            if done.wait(10):
                fanout.append((max(got[seq]) - t0) * 1000)
            time.sleep(0.05)
        # hook cost: one report() call on a connected client with a realistic payload
        c = clients[0]
        payload = chunks_for(0, 4, 0.01)
        seqlens = [[4096, 2048, 2048], [8192], [1000, 7192], [512] * 16]
        for i in range(3000):
            t = time.perf_counter_ns()
            c.report(10_000 + i, 0.1, 1.0, seqlens, payload)
            hook_us.append((time.perf_counter_ns() - t) / 1000)
            if i % 8 == 7:
                time.sleep(0.002)  # steps are far apart in real training; let the sender drain
    finally:
        for c in clients:
            c.close(clean=True, timeout=1.0)
        stop(procs)
        server.stop()
    return fanout, hook_us


# --- 4. agent footprint ---------------------------------------------------------------------
def bench_agent(run: Path, seconds: float) -> tuple[float, float]:
    cfg = CoordinatorConfig(world_size=8, tp=2, pp=2, run_dir=str(run), token=TOKEN, auto_reconfigure=False,
                            metrics_port=-1, job="bench")
    server = CoordinatorServer(cfg)
    server.start()
    agent, hook = start_agent(run, "n0", server.address, 8, ["--sample-interval-s", "1.0"])
    clients = [AgentClient(r, hook, r, "bench", reshapes=True, credential=rank_token(TOKEN)).start() for r in range(8)]
    proc = psutil.Process(agent.pid)
    try:
        seq = [[700, 324], [512, 512]]
        it = 0

        def step() -> None:
            nonlocal it
            for c in clients:
                c.report(it, 0.1, time.time() - 0.1, seq, chunks_for(c.rank, 2, 0.01))
            it += 1

        t_end = time.monotonic() + 3.0  # warm up
        while time.monotonic() < t_end:
            step()
            time.sleep(0.1)
        cpu0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
        nxt = time.monotonic()
        while time.monotonic() - w0 < seconds:
            step()
            nxt += 0.1
            time.sleep(max(0.0, nxt - time.monotonic()))
        cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - w0) * 100
        rss = proc.memory_info().rss / 2**20
    finally:
        for c in clients:
            c.close()
        stop([agent])
        server.stop()
    return cpu, rss


# --- 5. coordinator at 1,024 ranks -----------------------------------------------------------------
def bench_coordinator_1024(run: Path, seconds: float) -> tuple[float, int]:
    world, per_agent = 1024, 128
    env = {**os.environ, "RESIHP_TOKEN": TOKEN}
    coord = subprocess.Popen([PY, "-m", "resihp.cli", "coordinator", "--run-dir", str(run), "--job", "bench", "-n",
                              str(world), "--tp", "8", "--pp", "4", "--model", "llama2-7b", "--microbatches", "128",
                              "--no-auto-reconfigure", "--log-level", "WARNING", "--metrics-port", "-1"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = run / "coordinator.json"
    addr = wait(lambda: info.exists() and json.loads(info.read_text()), 60, "coordinator")["grpc"]
    md = metadata(TOKEN)
    stop_ev = threading.Event()
    joined = [0]
    from resihp.coordinator.model.plan import Plan

    plan = Plan.uniform(8, 4, 32, 32, 128)
    t0 = time.time()

    def fake_agent(k: int) -> None:
        ch = grpc.insecure_channel(addr)
        stub = pbg.CoordinatorStub(ch)
        ranks = range(k * per_agent, (k + 1) * per_agent)
        reg = stub.Register(pb.RegisterRequest(node=f"n{k}", job="bench",
                                               ranks=[pb.LocalRank(rank=r, local_rank=r % 8, pid=1, reshapes=True) for r in ranks]),
                            metadata=md, timeout=10)
        seqs = [[3000, 1096], [4096], [2048, 2048], [1024, 3072]]
        chunk_cache = {r: [codec.chunk_to_pb(c) for c in chunks_for(r, 4, 0.01)] for r in ranks}

        def messages() -> Any:
            yield pb.AgentMessage(agent_id=reg.agent_id)
            it = 0
            nxt = time.time()
            while not stop_ev.is_set():
                now = time.time()
                reports = [pb.RankReport(rank=r, epoch=0, iteration=it, start_s=now - 0.5, step_s=0.5,
                                         microbatches=[pb.MicroBatch(seqlens=s) for s in seqs],
                                         chunks=chunk_cache[r]) for r in ranks]
                beats = [pb.RankHeartbeat(rank=r, time_s=now, iteration=it) for r in ranks]
                yield pb.AgentMessage(agent_id=reg.agent_id, reports=reports,
                                      heartbeat=pb.AgentHeartbeat(time_s=now, ranks=beats))
                it += 1
                for _ in range(2):  # heartbeats at 2 Hz in between
                    nxt += 0.5
                    stop_ev.wait(max(0.0, nxt - time.time()))
                    if stop_ev.is_set():
                        return
                    if _ == 0:
                        now = time.time()
                        yield pb.AgentMessage(agent_id=reg.agent_id, heartbeat=pb.AgentHeartbeat(
                            time_s=now, ranks=[pb.RankHeartbeat(rank=r, time_s=now, iteration=it) for r in ranks]))

        try:
            for _ in stub.Stream(messages(), metadata=md):
                pass
        except grpc.RpcError:
            pass
        ch.close()

    threads = [threading.Thread(target=fake_agent, args=(k,), daemon=True) for k in range(world // per_agent)]
    for t in threads:
        t.start()
    proc = psutil.Process(coord.pid)
    try:
        time.sleep(12.0)  # warm-up: the detector calibrates its cost model
        cpu0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - w0) * 100
        admin = pbg.AdminStub(grpc.insecure_channel(addr))
        joined[0] = int(admin.Status(pb.StatusRequest(), metadata=md, timeout=10).iteration)
    finally:
        stop_ev.set()
        stop([coord])
        for t in threads:
            t.join(5)
    _ = plan, t0
    return cpu, joined[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = ap.parse_args(argv)
    q = args.quick
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="resihp-bench-") as tmp:
        root = Path(tmp)
        dirs = {k: root / k for k in ("finding", "fanout", "agent", "c1024")}
        for d in dirs.values():
            d.mkdir()
        lat = bench_report_to_finding(dirs["finding"], 6 if q else 20)
        fan, hook = bench_fanout(dirs["fanout"], 10 if q else 40)
        agent_cpu, agent_rss = bench_agent(dirs["agent"], 5 if q else 15)
        coord_cpu, joined = bench_coordinator_1024(dirs["c1024"], 8 if q else 20)
    result = {
        "report_to_finding_ms_p50": round(pct(lat, 50), 3), "report_to_finding_ms_p99": round(pct(lat, 99), 3),
        "command_fanout_ms_p50": round(pct(fan, 50), 3), "command_fanout_ms_p99": round(pct(fan, 99), 3),
        "hook_report_us_p50": round(pct(hook, 50), 3), "hook_report_us_p99": round(pct(hook, 99), 3),
        "agent_cpu_percent": round(agent_cpu, 3), "agent_rss_mb": round(agent_rss, 2),
        "coordinator_cpu_percent_1024": round(coord_cpu, 2),
        "findings_measured": len(lat), "fanout_commands": len(fan), "iterations_joined_1024": joined,
        "hook_flush_s": AgentClient(0, None).flush_s, "bench_seconds": round(time.monotonic() - t_start, 1),
    }
    goals = {"hook_report_us_p50": 50, "agent_cpu_percent": 2, "agent_rss_mb": 80, "coordinator_cpu_percent_1024": 25}
    print(f"{'metric':<32} {'value':>12}  goal")
    for k, v in result.items():
        print(f"{k:<32} {v:>12}  {('<= ' + str(goals[k])) if k in goals else ''}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
