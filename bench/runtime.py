"""Runtime benchmark: throughput per layout, hook overhead, cost-model error on real runs.

    python bench/runtime.py            # ~4–5 min on 2 cores; tables, then ONE JSON line

Two mpirun worlds, each with its own live coordinator and node agent (separate processes):

- **oversubscribed** (``mpirun -n 8`` on the 2 cores): every layout in turn (ranks outside
  a layout wait, blocked, not spinning): TP2×PP2×DP2 (8 ranks), TP2×PP2, PP4, DP4, PP2×DP2
  with unequal shares (3, 5) (4 ranks each) and a single rank — their throughput
  (``tokens_per_s``) and, under ``oversubscribed``, their model errors and hook overhead.
- **dedicated** (``mpirun -n 2``: one rank per core, the setting the cost model and the
  schedule simulator describe — a device per rank): TP2, PP2, DP2, DP2 with shares (3, 5),
  single. The headline ``mtp_mape_real``, ``itp_mape_real`` and ``hook_overhead_ratio``
  (on PP2) come from here. Even here the two ranks share the machine's caches and memory
  bandwidth with each other and with the control plane's processes.

All on gpt-tiny with 128-token packed micro-batches of the stdlib's sources, 8 micro-batches
per global batch. Each layout records its trace; bench/runtime_analysis.py reads them.

- ``tokens_per_s``: global-batch tokens over the wall time of the measured steps.
- ``hook_overhead_ratio``: iteration time with the two calls (reporting to a live node
  agent of a live coordinator, and the trace) over without, in alternating blocks of
  iterations (median of per-block means), so machine noise hits both alike; the table also
  shows the time of the per-iteration call itself on rank 0. The hooks report in batches
  (one flush a second), so the agent and the coordinator handle a block's reports up to a
  flush later: a block lasts at least ``BLOCK_FLUSHES`` flushes, else that work would land
  in the next block without the calls and the ratio would hide it.
- ``mtp_mape_real``: per micro-batch compute time (F + B of one micro-batch on one rank)
  predicted by the cost model (coordinator.costmodel, T = α·tokens + β·Σl² + γ per
  (layout, rank, kind)) calibrated on the first half of the measured iterations, scored on
  the second half.
- ``mtp_mape_real_cpu_clock``: the same, on more steps of the same job with compute chunks
  timed in CPU time (TrainConfig.compute_clock = "cpu"): the cost model's own error, without
  the other jobs that share this machine's cores.
- ``itp_mape_real``: iteration time predicted by the schedule simulator
  (coordinator.schedule.simulate_iteration) from those calibrated chunk costs plus the
  measured P2P latency, gradient all-reduce and optimizer time, scored on the second half.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime_analysis import analyse, host_speed, overhead_interval  # bench/runtime_analysis.py

from resihp.coordinator.protocol.auth import RANK_TOKEN_ENV, rank_token

REPO = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"
BENCH_TOKEN = "bench-token-0123456789"
LAYOUTS = ("tp2pp2dp2", "tp2pp2", "pp4", "dp4", "pp2dp2_unequal", "single")
# one rank per core (this machine has two): the setting the cost model and the schedule
# simulator describe — a device per rank — so their errors are judged here
DEDICATED = ("tp2", "pp2", "dp2", "dp2_unequal", "single")
GLOBAL_MB = 8
SEQ = 128
BLOCK_FLUSHES = 3  # overhead blocks last at least this many of the hooks' flush intervals


# --- worker (runs under mpirun) ------------------------------------------------------------
def _plan(name: str, layers: int) -> Any:
    from resihp.coordinator.model.plan import PipelinePlan, Plan

    uniform = {"tp2pp2dp2": (2, 2, 2), "tp2pp2": (2, 2, 1), "pp4": (1, 4, 1), "dp4": (1, 1, 4), "tp2": (2, 1, 1),
               "pp2": (1, 2, 1), "dp2": (1, 1, 2), "single": (1, 1, 1)}  # (tp, pp, dp)
    if name in uniform:
        return Plan.uniform(*uniform[name], layers, GLOBAL_MB)
    if name in ("pp2dp2_unequal", "dp2_unequal"):  # two replicas with shares (3, 5)
        base = Plan.uniform(1, 2 if name == "pp2dp2_unequal" else 1, 2, layers, GLOBAL_MB)
        return Plan(replicas=tuple(PipelinePlan(r.stages, r.layers, s) for r, s in zip(base.replicas, (3, 5))))
    raise ValueError(f"unknown layout {name!r}")


def enter_layout(boot: Any, spec: Any, cfg: Any, name: str, epoch: int) -> tuple[Any, Any, Any]:
    """Start layout ``name`` in the world (collective): (plan, communicator of its members or of
    the ranks it leaves out, this rank's Runtime or None where the layout leaves it out)."""
    from resihp.trainer_hooks.runtime.groups import make_groups
    from resihp.trainer_hooks.runtime.trainer import Runtime

    plan = _plan(name, spec.num_layers)
    boot.init_epoch(epoch)
    member = plan.has_rank(boot.rank)
    comm = boot.comm.Split(0 if member else 1, boot.rank)
    if not member:
        make_groups([plan], boot.rank)  # every rank creates every group
        return plan, comm, None
    return plan, comm, Runtime(spec, plan, boot.rank, cfg, epoch=epoch)


def worker(out: Path, layouts: tuple[str, ...], overhead_layout: str, steps: int, warmup: int, blocks: int,
           block_len: int) -> int:
    import torch

    from resihp.coordinator.model.spec import preset
    from resihp.trainer_hooks.hooks import Job
    from resihp.trainer_hooks.launch.bootstrap import Bootstrap
    from resihp.trainer_hooks.reporting.reporter import AgentTransport, NullTransport, Transport
    from resihp.trainer_hooks.reporting.trace_writer import RankIteration, TraceCollector, make_header
    from resihp.trainer_hooks.runtime.groups import destroy_groups
    from resihp.trainer_hooks.runtime.throttle import Throttle
    from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

    torch.set_num_threads(1)
    spec = preset("gpt-tiny")
    cfg = TrainConfig(seed=1, max_seq_len=SEQ, compute_clock="wall")  # the second pass switches to "cpu"
    boot = Bootstrap(timeout_s=300)
    busy = busy_probe(boot.comm)
    if boot.rank == 0:
        (out / "busy.json").write_text(json.dumps(busy))
    epoch = 0
    for name in layouts:
        plan, comm, maybe_rt = enter_layout(boot, spec, cfg, name, epoch)
        if maybe_rt is not None:
            rt = maybe_rt
            local = comm.Get_rank()
            t0 = comm.bcast(time.time() if local == 0 else None, root=0)

            def traced(fname: str, first: int, count: int) -> tuple[int, float]:
                fh = open(out / fname, "w", encoding="utf-8") if local == 0 else None
                header = make_header(spec, plan, boot.nodes[: comm.Get_size()], name, SEQ, {"layout": name}) if fh else None
                coll = TraceCollector(comm, local, 0, plan, every=count, out=fh, header=header)
                comm.Barrier()
                start = time.perf_counter()
                tokens = 0
                for it in range(first, first + count):
                    r = rt.train_step(it)
                    tokens += r.global_tokens
                    coll.record(RankIteration(local, it, r.replica, r.wall_start_s - t0, r.time_s, r.seqlens,
                                              tuple(r.chunks)))
                wall = time.perf_counter() - start
                coll.close()
                if fh:
                    fh.close()
                return tokens, wall

            for it in range(warmup):
                rt.train_step(it)
            tokens, wall = traced(f"{name}.jsonl", warmup, steps)
            rt.pipeline.compute_clock = "cpu"  # the same job again, compute chunks timed in CPU time
            traced(f"{name}.cpu.jsonl", warmup + steps, steps)
            if local == 0:
                (out / f"{name}.json").write_text(json.dumps({"tokens": tokens, "wall_s": wall, "ranks": comm.Get_size()}))
            destroy_groups(rt.groups)
        comm.Free()
        epoch += 1

    # hook overhead: the whole world's job, alternating blocks with and without the two calls
    plan = _plan(overhead_layout, spec.num_layers)
    boot.init_epoch(epoch)
    rt = Runtime(spec, plan, boot.rank, cfg, epoch=epoch)
    addr = os.environ.get("RESIHP_AGENT_ADDR", "")
    transport: Transport = AgentTransport(boot.rank, addr, boot.local_rank, "bench") if addr else NullTransport(
        boot.rank, "bench/runtime.py found no agent")
    fh = open(out / "overhead.jsonl", "w", encoding="utf-8") if boot.rank == 0 else None
    header = make_header(spec, plan, boot.nodes, "overhead", SEQ, {}) if fh else None
    coll = TraceCollector(boot.comm, boot.rank, 0, plan, every=20, out=fh, header=header)
    job = Job(boot=boot, model=spec, plan=plan, config=cfg, transport=transport, throttle=Throttle(), runtime=rt,
              trace=coll)
    step_s = 0.0
    for it in range(warmup):
        r = rt.train_step(it)
        job.step(r)
        step_s = r.time_s
    it = warmup
    # The hooks send reports in batches every flush_s; the agent and coordinator do a with-block's
    # work when its batches arrive, up to flush_s after the iterations. A block much shorter than
    # that would push its control-plane work into the next without-block and hide it, so blocks
    # span at least BLOCK_FLUSHES flush intervals (rank 0's warm-up step time decides, for all).
    flush_s = float(getattr(getattr(transport, "client", None), "flush_s", 0.0))
    step_s = boot.comm.bcast(step_s, root=0)
    block_len = max(block_len, math.ceil(BLOCK_FLUSHES * flush_s / step_s)) if step_s > 0 else block_len
    times: dict[str, list[float]] = {"with": [], "without": [], "call": []}
    for b in range(2 * blocks):
        mode = "with" if b % 2 == 0 else "without"
        boot.comm.Barrier()
        start = time.perf_counter()
        for _ in range(block_len):
            r = rt.train_step(it)
            if mode == "with":
                t_call = time.perf_counter()
                job.step(r)  # the per-iteration call (reporting + trace + command poll)
                times["call"].append(time.perf_counter() - t_call)
            it += 1
        times[mode].append((time.perf_counter() - start) / block_len)
    coll.close()
    if fh:
        fh.close()
    if boot.rank == 0:
        (out / "overhead.json").write_text(json.dumps({**times, "agent": addr, "block_len": block_len, "flush_s": flush_s,
                                                        "sent": getattr(getattr(transport, "client", None), "sent", 0)}))
    transport.close()
    destroy_groups(rt.groups)
    boot.close()
    return 0


def busy_probe(comm: Any, seconds: float = 1.0) -> dict[str, Any]:
    """The share of a core a plain busy loop gets (CPU time over wall time, no torch): one rank
    alone, then every rank at once — what this machine gives a rank when its neighbours
    compute too. Measured, not fitted: the shared-host model's only input about the machine."""
    def spin() -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            pass
        return (time.process_time() - c0) / (time.perf_counter() - t0)

    comm.Barrier()
    alone = spin() if comm.Get_rank() == 0 else 0.0
    comm.Barrier()
    together = spin()
    comm.Barrier()
    return {"alone": alone, "together": comm.allgather(together), "ranks": comm.Get_size()}


# --- driver ----------------------------------------------------------------------------------
WORLDS = {  # name: (ranks, plan of the coordinator and of the overhead job, layouts)
    "oversubscribed": (8, (2, 2, 2), LAYOUTS),
    "dedicated": (2, (1, 2, 1), DEDICATED),
}


def start_control_plane(run: Path, ranks: int, tp: int, pp: int, dp: int) -> tuple[list[subprocess.Popen[bytes]], str]:
    """A live coordinator and one node agent (the control plane's own processes)."""
    env = {**os.environ, "RESIHP_TOKEN": BENCH_TOKEN, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-m", "resihp.cli", *args], env=env, cwd=str(REPO),
                             stdout=open(run / f"{name}.out", "ab"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def wait_file(path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited: {(run / (what + '.out')).read_text()[-2000:]}")
            if path.exists():
                try:
                    return dict(json.loads(path.read_text()))
                except json.JSONDecodeError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start within 60 s")

    coord = spawn("coordinator", ["coordinator", "--run-dir", str(run), "--job", "bench", "-n", str(ranks),
                                  "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--microbatches", str(GLOBAL_MB),
                                  "--port", "0", "--metrics-port", "-1", "--no-auto-reconfigure",
                                  "--log-level", "WARNING"])
    addr = wait_file(run / "coordinator.json", coord, "coordinator")["grpc"]
    node = os.uname().nodename
    agent = spawn("agent", ["agent", "--node", node, "--job", "bench", "--coordinator", addr, "--run-dir", str(run),
                            "--world-size", str(ranks), "--gpu-sampler", "nvml", "--log-level", "WARNING"])
    hook = wait_file(run / f"agent-{node}.json", agent, "agent")["hook"]
    return procs, str(hook)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def run_world(run: Path, world: str, args: argparse.Namespace) -> tuple[float, str]:
    """One mpirun world (with its own live coordinator and agent): every layout, then the overhead job."""
    ranks, (tp, pp, dp), layouts = WORLDS[world]
    run.mkdir(parents=True)
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "RESIHP_AGENT_ADDR": "", RANK_TOKEN_ENV: rank_token(BENCH_TOKEN)}  # the ranks' credential
    agent_note = "none"
    try:
        if not args.no_agent:
            try:
                procs, hook = start_control_plane(run, ranks, tp, pp, dp)
                env["RESIHP_AGENT_ADDR"] = agent_note = hook
            except (RuntimeError, OSError) as exc:
                print(f"warning: no live agent ({exc}); measuring the hooks without one", file=sys.stderr)
        cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(ranks),
               "-x", "RESIHP_AGENT_ADDR", "-x", RANK_TOKEN_ENV, "-x", "PYTHONHASHSEED=0",
               sys.executable, str(Path(__file__).resolve()), "--worker", str(run), "--world", world,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--blocks", str(args.blocks),
               "--block-len", str(args.block_len)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), timeout=900, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{world} world failed: {proc.stdout[-3000:]} {proc.stderr[-5000:]}")
        return time.perf_counter() - t, agent_note
    finally:
        stop(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per layout")
    ap.add_argument("--dedicated-steps", type=int, default=16, help="measured steps per layout, one rank per core")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6, help="overhead: blocks per mode")
    ap.add_argument("--block-len", type=int, default=4,
                    help="overhead: iterations per block, at least (blocks span BLOCK_FLUSHES report flushes)")
    ap.add_argument("--no-agent", action="store_true", help="measure the hooks without a live agent")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--world", default="oversubscribed", choices=sorted(WORLDS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _, (tp, pp, dp), layouts = WORLDS[args.world]
        return worker(Path(args.worker), layouts, "tp2pp2dp2" if args.world == "oversubscribed" else "pp2",
                      args.steps, args.warmup, args.blocks, args.block_len)

    base = Path(tempfile.mkdtemp(prefix="resihp-bench-runtime-"))
    walls: dict[str, float] = {}
    agents: dict[str, str] = {}
    try:
        walls["oversubscribed"], agents["oversubscribed"] = run_world(base / "oversubscribed", "oversubscribed", args)
        ded = argparse.Namespace(**{**vars(args), "steps": args.dedicated_steps})
        walls["dedicated"], agents["dedicated"] = run_world(base / "dedicated", "dedicated", ded)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1

    def table(world: str) -> tuple[dict[str, float], dict[str, dict[str, float]], float, dict[str, Any]]:
        run = base / world
        tps: dict[str, float] = {}
        errs: dict[str, dict[str, float]] = {}
        speed = host_speed(json.loads((run / "busy.json").read_text()))
        print(f"host: a busy rank's speed while k = 1..{len(speed)} ranks compute: "
              f"{', '.join(f'{x:.2f}' for x in speed)} (busy-loop probe)")
        print(f"{'layout':<16}{'ranks':>6}{'tokens/s':>11}{'iter s':>9}{'MTP MAPE':>10}{'MTP(cpu)':>10}{'ITP MAPE':>10}"
              f"{'MTP ded.':>10}{'ITP ded.':>10}")
        for name in WORLDS[world][2]:
            meta = json.loads((run / f"{name}.json").read_text())
            tps[name] = meta["tokens"] / meta["wall_s"]
            a = analyse(run / f"{name}.jsonl", speed)
            d = analyse(run / f"{name}.jsonl")
            cpu = analyse(run / f"{name}.cpu.jsonl")["mtp_mape"]  # CPU time: each rank's own work, unshared
            errs[name] = {"mtp": a["mtp_mape"], "mtp_cpu": cpu, "itp": a["itp_mape"], "mtp_ded": d["mtp_mape"],
                          "itp_ded": d["itp_mape"]}
            print(f"{name:<16}{meta['ranks']:>6}{tps[name]:>11.0f}{a['iteration_s']:>9.3f}{a['mtp_mape']:>10.3f}"
                  f"{cpu:>10.3f}{a['itp_mape']:>10.3f}{d['mtp_mape']:>10.3f}{d['itp_mape']:>10.3f}")
        over = json.loads((run / "overhead.json").read_text())
        ratio = statistics.median(over["with"]) / statistics.median(over["without"])
        lo, hi = overhead_interval(over["with"], over["without"])
        over["ci90"] = [round(lo, 4), round(hi, 4)]
        print(f"hook overhead ({'TP2xPP2xDP2' if world == 'oversubscribed' else 'PP2'}, agent {agents[world]}, "
              f"{over['sent']} reports sent by rank 0, {len(over['with'])}x2 blocks of {over['block_len']} iterations, "
              f"hooks flush every {over['flush_s']:g} s): with {statistics.median(over['with']):.4f} s/it, "
              f"without {statistics.median(over['without']):.4f} s/it, ratio {ratio:.4f} "
              f"(90 % interval {lo:.4f}-{hi:.4f}); the call itself "
              f"{statistics.median(over['call']) * 1e3:.2f} ms (median on rank 0)")
        print(f"mpirun wall time {walls[world]:.0f} s; traces in {run}\n")
        return tps, errs, ratio, over

    print("== 8 ranks on 2 cores (oversubscribed): throughput of every layout")
    tps, errs_over, ratio_over, over_over = table("oversubscribed")
    print("== one rank per core: the cost model's and the schedule simulator's error, the hook overhead")
    tps_ded, errs, ratio, over_ded = table("dedicated")
    print("MTP / ITP: the shared-host model (chunk costs as a rank alone runs them, predicted by the "
          "processor-sharing simulator at the probed host speed); ded.: every rank a device of its own.\n"
          "MTP(cpu): the dedicated model on the same job with compute chunks timed in CPU time")

    def mean(d: dict[str, dict[str, float]], key: str) -> float:
        return round(statistics.mean(v[key] for v in d.values()), 4)

    result = {
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "tokens_per_s_dedicated": {k: round(v, 1) for k, v in tps_ded.items()},
        "hook_overhead_ratio": round(ratio, 4),
        "hook_overhead_ci90": over_ded["ci90"],
        "mtp_mape_real": mean(errs, "mtp"),
        "itp_mape_real": mean(errs, "itp"),
        "mtp_mape_real_cpu_clock": mean(errs, "mtp_cpu"),
        "mtp_mape_real_dedicated_model": mean(errs, "mtp_ded"),
        "itp_mape_real_dedicated_model": mean(errs, "itp_ded"),
        "mtp_mape_by_layout": {n: round(v["mtp"], 4) for n, v in errs.items()},
        "itp_mape_by_layout": {n: round(v["itp"], 4) for n, v in errs.items()},
        "oversubscribed": {"hook_overhead_ratio": round(ratio_over, 4), "hook_overhead_ci90": over_over["ci90"],
                           "mtp_mape_real": mean(errs_over, "mtp"),
                           "itp_mape_real": mean(errs_over, "itp"),
                           "mtp_mape_real_cpu_clock": mean(errs_over, "mtp_cpu"),
                           "itp_mape_by_layout": {n: round(v["itp"], 4) for n, v in errs_over.items()}},
        "agent": all(a != "none" for a in agents.values()),
        "seq": SEQ, "global_microbatches": GLOBAL_MB, "model": "gpt-tiny",
    }
    if os.environ.get("RESIHP_BENCH_KEEP", "") != "1":
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
