"""Simulator against reality: ``sim/perf.py``'s iteration times against real CPU runs.

    python bench/sim_vs_real.py [--steps N] [--warmup N]   # ~30–60 s on 2 cores

One ``mpirun -n 2`` world (one rank per core: the "dedicated" setting of
``bench/runtime.py``) runs gpt-tiny on 128-token packed micro-batches, 8 per global batch,
in four layouts — single rank, TP2, PP2, DP2 — plus a gloo ping-pong between the two ranks.

The machine is then described to the simulator the way a user describes a cluster, from
ONE reference measurement (the single-rank run) and the ping-pong:

- ``device_flops``: achieved FLOP/s of the F and B chunks (cost-model FLOPs of each
  micro-batch's real packed documents over their measured time);
- ``device_mem_bw_Bps``: what AdamW's step achieves (bytes it touches per parameter × the
  rank's parameters over the measured OPT time);
- link bandwidth and latency: a least-squares line through the ping-pong's one-way times
  (the same loopback for "intra" and "inter" node: this is one machine).

Every other layout is predicted with ``PerfModel.iteration_s`` — the code path the cluster
simulation judges policies by — with no per-layout fitting (bench/sim_calibration.py).
``sim_vs_real_mape`` is the mean absolute percentage error over the predicted layouts; the
reference is reported but excluded. The diagnosis columns split each layout's real time into compute (F+B), waits
(P2P), DP all-reduce and optimizer on its slowest rank, against the model's terms, and show
what the machine gave each rank (main-thread CPU per iteration, CPU / wall time, a plain
busy loop's share of a core alone and with both ranks busy).

What the error comes from, as measured here: the perf model gives every rank a device of
its own; this VM gives the job's two busy ranks about one core between them (busy loop:
1.00 of a core alone, ≈ 0.55 each at once, while other engineers' jobs run), so PP2 and DP2
take ≈ 2× the predicted wall time while their CPU work per iteration is what the model
predicts; and TP2 on gpt-tiny (32-wide shards) is per-op-overhead bound: a TP2 rank spends
as much CPU per iteration as the single rank does for twice the FLOPs.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import MPIRUN, REPO, SEQ, _plan, busy_probe, enter_layout  # noqa: E402  (bench/runtime.py)
from sim_calibration import (  # noqa: E402  (bench/sim_calibration.py)
    MODEL,
    REFERENCE,
    Row,
    _positive,
    calibrate,
    compare,
    mape,
    microbatch_flops,
    model_terms,
    predict,
    typical_seqlens,
)

from resihp.coordinator.model.spec import ModelSpec, SpecError, preset  # noqa: E402

LAYOUTS = ("single", "tp2", "pp2", "dp2")
BUSY_REFERENCE = "dp2"  # diagnosis only: the device measured with both ranks computing
PING_BYTES = (4 << 10, 32 << 10, 256 << 10, 2 << 20)


# --- real runs (under mpirun) -----------------------------------------------------------------
def _pingpong(rank: int, reps: int) -> list[tuple[float, float]]:
    """(bytes, median one-way seconds) between ranks 0 and 1 over gloo, as the runtime talks."""
    import torch
    import torch.distributed as dist

    out = []
    for size in PING_BYTES:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for i in range(reps + 2):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            else:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
            if i >= 2:  # the first round trips set up the pair
                times.append((time.perf_counter() - t) / 2.0)
        out.append((float(size), statistics.median(times)))
    return out


def _allreduce_probe(reps: int) -> list[tuple[float, float]]:
    """(bytes, median seconds) of a gloo all-reduce over both ranks: TP activations
    (128 × 64 fp32) and the whole model's gradients — diagnosis, not calibration."""
    import torch
    import torch.distributed as dist

    out = []
    for size in (SEQ * 64 * 4, 1 << 21):
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for i in range(reps + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            if i >= 2:
                times.append(time.perf_counter() - t)
        out.append((float(size), statistics.median(times)))
    return out


def worker(out: Path, layouts: Sequence[str], steps: int, warmup: int) -> int:
    import torch

    from resihp.trainer_hooks.launch.bootstrap import Bootstrap
    from resihp.trainer_hooks.runtime.groups import destroy_groups
    from resihp.trainer_hooks.runtime.trainer import TrainConfig

    torch.set_num_threads(1)
    spec = preset(MODEL)
    cfg = TrainConfig(seed=1, max_seq_len=SEQ, compute_clock="wall")  # against wall iterations
    boot = Bootstrap(timeout_s=300)
    boot.init_epoch(0)
    ping = _pingpong(boot.rank, 40)
    probe = _allreduce_probe(30)
    busy = busy_probe(boot.comm)
    if boot.rank == 0:
        (out / "busy.json").write_text(json.dumps({"alone": busy["alone"], "both": busy["together"]}))
        (out / "pingpong.json").write_text(json.dumps(ping))
        (out / "allreduce.json").write_text(json.dumps(probe))
    for epoch, name in enumerate(layouts, start=1):
        plan, comm, rt = enter_layout(boot, spec, cfg, name, epoch)
        if rt is not None:
            mine: list[dict[str, Any]] = []
            for it in range(warmup + steps):
                comm.Barrier()  # every step starts together: its time is the slowest rank's
                cpu0, proc0 = time.thread_time(), time.process_time()
                r = rt.train_step(it)
                cpu = time.thread_time() - cpu0  # the main thread's CPU: compute, Python, optimizer
                proc = time.process_time() - proc0  # all threads (gloo's, the store's)
                if it >= warmup:
                    mine.append({"time_s": r.time_s, "cpu_s": cpu, "proc_cpu_s": proc,
                                 "seqlens": [list(s) for s in r.seqlens],
                                 "chunks": [(k, mb, e - s) for k, mb, _, s, e in r.chunks]})
            per_rank = comm.gather({"rank": boot.rank, "steps": mine}, root=0)
            if comm.Get_rank() == 0:
                (out / f"{name}.json").write_text(json.dumps(per_rank))
            destroy_groups(rt.groups)
        comm.Free()
    boot.close()
    return 0


@dataclass(frozen=True)
class Measured:
    """One layout's real run, reduced: median iteration time (slowest rank) and the
    slowest rank's per-iteration medians of each chunk kind."""

    layout: str
    iteration_s: float
    spread: tuple[float, float]  # (min, max) iteration time of the measured steps
    parts: Mapping[str, float]  # F, B, P2P, DP, OPT seconds per iteration on the slowest rank
    fb_per_mb: tuple[float, float]  # median F and B seconds of one micro-batch (any rank)
    cpu_share: float  # the slowest rank's main-thread CPU time over its wall time per step (median)
    proc_share: float  # the same for all threads of its process
    cpu_s: float  # the slowest rank's main-thread CPU seconds per iteration (median)
    achieved_flops: float  # F/B FLOPs over their wall time, all ranks: the device as it ran here


def achieved_flops(layout: str, per_rank: list[dict[str, Any]], spec: ModelSpec) -> float:
    """Cost-model FLOPs of every measured F/B chunk over their summed wall time."""
    plan = _plan(layout, spec.num_layers)
    flops = secs = 0.0
    for r in per_rank:
        pos = plan.position(r["rank"])
        rep = plan.replicas[pos.replica]
        for s in r["steps"]:
            for k, mb, d in s["chunks"]:
                if k in ("F", "B"):
                    f, b = microbatch_flops(spec, s["seqlens"][mb], rep.layers[pos.stage], pos.tp_size,
                                            pos.stage == 0, pos.stage == rep.pp - 1)
                    flops += f if k == "F" else b
                    secs += d
    return flops / _positive(f"{layout}: F/B time", secs)


def reduce_run(layout: str, per_rank: list[dict[str, Any]], spec: ModelSpec) -> Measured:
    steps = len(per_rank[0]["steps"])
    if steps == 0 or any(len(r["steps"]) != steps for r in per_rank):
        raise ValueError(f"sim_vs_real: {layout}: ranks recorded {[len(r['steps']) for r in per_rank]} steps")
    its = [max(r["steps"][i]["time_s"] for r in per_rank) for i in range(steps)]
    slow = max(per_rank, key=lambda r: statistics.median(s["time_s"] for s in r["steps"]))
    parts = {k: statistics.median(sum(d for kk, _, d in s["chunks"] if kk == k) for s in slow["steps"])
             for k in ("F", "B", "P2P", "DP", "OPT", "TP")}
    f = [d for r in per_rank for s in r["steps"] for k, _, d in s["chunks"] if k == "F"]
    b = [d for r in per_rank for s in r["steps"] for k, _, d in s["chunks"] if k == "B"]
    share = statistics.median(s["cpu_s"] / s["time_s"] for s in slow["steps"])
    proc = statistics.median(s["proc_cpu_s"] / s["time_s"] for s in slow["steps"])
    return Measured(layout, statistics.median(its), (min(its), max(its)), parts,
                    (statistics.median(f), statistics.median(b)), share, proc,
                    statistics.median(s["cpu_s"] for s in slow["steps"]),
                    achieved_flops(layout, per_rank, spec))


def reference_inputs(per_rank: list[dict[str, Any]]) -> tuple[list[tuple[str, tuple[int, ...], float]], float]:
    """(F/B chunks with their documents, median optimizer seconds) of a run whose every rank
    holds the whole model (single, or DP replicas)."""
    chunks = []
    opt = []
    for r in per_rank:
        for s in r["steps"]:
            lens = s["seqlens"]  # this replica's micro-batches
            chunks += [(k, tuple(lens[mb]), d) for k, mb, d in s["chunks"] if k in ("F", "B")]
            opt += [d for k, _, d in s["chunks"] if k == "OPT"]
    return chunks, statistics.median(opt) if opt else 0.0


def op_overhead(per_rank: list[dict[str, Any]]) -> float:
    """The runtime's own time per F or B op: a step's time outside every recorded chunk over its
    F and B ops, median over the reference run's steps (Python, bookkeeping, message posting;
    the simulator's ops run back to back)."""
    out = []
    for r in per_rank:
        for s in r["steps"]:
            ops = sum(1 for k, _, _ in s["chunks"] if k in ("F", "B"))
            if ops:
                out.append(max(0.0, s["time_s"] - sum(d for k, _, d in s["chunks"] if k != "TP")) / ops)
    return statistics.median(out) if out else 0.0


def machine_load() -> dict[str, float]:
    """Load average and CPU pressure (share of time some runnable task waited for a CPU,
    10 s average; Linux PSI) — what the other tenants of the shared cores were doing."""
    out: dict[str, float] = {}
    try:
        out["loadavg_1m"] = float(Path("/proc/loadavg").read_text().split()[0])
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        out["cpu_pressure_pct"] = float(some.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return out




Records = tuple[dict[str, list[dict[str, Any]]], list[tuple[float, float]], list[tuple[float, float]],
                dict[str, Any]]


def load_runs(tmp: str, layouts: Sequence[str] = LAYOUTS) -> Records:
    """The raw records a worker left in ``tmp`` (or a --keep directory)."""
    try:
        runs = {name: json.loads((Path(tmp) / f"{name}.json").read_text()) for name in layouts}
        ping = [(float(b), float(t)) for b, t in json.loads((Path(tmp) / "pingpong.json").read_text())]
        probe = [(float(b), float(t)) for b, t in json.loads((Path(tmp) / "allreduce.json").read_text())]
        busy_file = Path(tmp) / "busy.json"
        busy = dict(json.loads(busy_file.read_text())) if busy_file.exists() else {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"sim_vs_real: cannot read the real runs' records in {tmp}: {exc}") from exc
    return runs, ping, probe, busy


def run_real(steps: int, warmup: int, layouts: Sequence[str] = LAYOUTS,
             keep: str = "") -> tuple[dict[str, list[dict[str, Any]]], list[tuple[float, float]],
                                      list[tuple[float, float]], dict[str, Any], float]:
    """One mpirun -n 2 world: the ping-pong and an all-reduce probe, then every layout.
    Returns (per-rank records per layout, ping-pong, all-reduce probe, busy-loop probe, mpirun
    wall seconds);
    ``keep``: a directory to copy the raw records to (re-analyse with --replay)."""
    with tempfile.TemporaryDirectory(prefix="resihp-sim-vs-real-") as tmp:
        cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2",
               "-x", "PYTHONHASHSEED=0", sys.executable, str(Path(__file__).resolve()), "--worker", tmp,
               "--steps", str(steps), "--warmup", str(warmup), "--layouts", ",".join(layouts)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=str(REPO), timeout=600, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"sim_vs_real: the mpirun world failed (rc {proc.returncode}): "
                               f"{proc.stdout[-2000:]} {proc.stderr[-4000:]}")
        runs, ping, probe, busy = load_runs(tmp, layouts)
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for f in Path(tmp).glob("*.json"):
                (Path(keep) / f.name).write_text(f.read_text())
            (Path(keep) / "wall.txt").write_text(f"{wall}\n")
    return runs, ping, probe, busy, wall


def measure(steps: int = 12, warmup: int = 3, verbose: bool = True, keep: str = "",
            replay: str = "") -> dict[str, Any]:
    """Real runs (or the records of earlier ones: ``replay``), calibration on the reference,
    predictions, table; the result as a dict."""
    load_before = machine_load()
    if replay:
        runs, ping, probe, busy = load_runs(replay)
        wall = float((Path(replay) / "wall.txt").read_text()) if (Path(replay) / "wall.txt").exists() else math.nan
        steps = len(runs[REFERENCE][0]["steps"])
        kept = Path(replay) / "load.json"  # the load while the kept runs ran, not now
        load_before, load_after = json.loads(kept.read_text()) if kept.exists() else ({}, {})
    else:
        runs, ping, probe, busy, wall = run_real(steps, warmup, keep=keep)
        load_after = machine_load()
        if keep:
            (Path(keep) / "load.json").write_text(json.dumps([load_before, load_after]))
    spec = preset(MODEL)
    measured = {name: reduce_run(name, recs, spec) for name, recs in runs.items()}
    chunks, opt_s = reference_inputs(runs[REFERENCE])
    cal = calibrate(spec, chunks, opt_s, ping, op_overhead_s=op_overhead(runs[REFERENCE]))
    lens = typical_seqlens([tuple(m) for s in runs[REFERENCE][0]["steps"] for m in s["seqlens"]])
    rows, ref = compare({n: m.iteration_s for n, m in measured.items()}, cal, lens)
    err = mape(rows)
    terms = {name: model_terms(name, cal, lens) for name in measured}
    # diagnosis only (not the metric): the simulator told each layout's own achieved compute
    # rate — what is left is the error of its structure (bubble, TP/P2P/DP comm, optimizer)
    told = {n: predict(n, replace(cal, device_flops=m.achieved_flops), lens) for n, m in measured.items()}
    # diagnosis: the same one-reference method with the device measured while BOTH ranks
    # compute (DP2 holds the whole model on each rank): the slowdown of busy neighbours is
    # then inside the device's speed, and the single-rank run becomes a prediction
    chunks2, opt2 = reference_inputs(runs[BUSY_REFERENCE])
    cal_busy = calibrate(spec, chunks2, opt2, ping, reference=BUSY_REFERENCE,
                         op_overhead_s=op_overhead(runs[BUSY_REFERENCE]))
    rows_busy, _ = compare({n: m.iteration_s for n, m in measured.items()}, cal_busy, lens)
    if verbose:
        print(f"machine as described to the simulator (calibrated on {REFERENCE!r} + a gloo ping-pong): "
              f"{cal.device_flops / 1e9:.2f} GFLOP/s per rank, optimizer {cal.device_mem_bw_Bps / 1e9:.2f} GB/s, "
              f"link {cal.link_bw_Bps / 1e9:.2f} GB/s + {cal.link_latency_s * 1e6:.0f} µs, "
              f"runtime {cal.op_overhead_s * 1e3:.2f} ms per F/B op")
        print(f"{'layout':<8}{'real s':>9}{'(min–max)':>16}{'sim s':>9}{'error':>8}  "
              f"{'real F+B':>9}{'P2P':>7}{'DP':>7}{'OPT':>7} | {'sim pipe':>9}{'DP':>7}{'OPT':>7}"
              f"{'GFLOP/s':>8}{'cpu s':>7}{'cpu/wall':>9}{'proc':>6}{'sim*':>8}{'err*':>7}  F/B per mb (ms)")
        for r in [ref, *rows]:
            m, t = measured[r.layout], terms[r.layout]
            tag = " (calibration, not scored)" if r.layout == REFERENCE else ""
            print(f"{r.layout:<8}{r.real_s:>9.4f}{f'({m.spread[0]:.3f}–{m.spread[1]:.3f})':>16}{r.sim_s:>9.4f}"
                  f"{r.error:>+8.1%}  {m.parts['F'] + m.parts['B']:>9.4f}{m.parts['P2P']:>7.4f}{m.parts['DP']:>7.4f}"
                  f"{m.parts['OPT']:>7.4f} | {t['pipeline_s']:>9.4f}{t['dp_s']:>7.4f}{t['opt_s']:>7.4f}"
                  f"{m.achieved_flops / 1e9:>8.2f}{m.cpu_s:>7.3f}{m.cpu_share:>9.2f}{m.proc_share:>6.2f}"
                  f"{told[r.layout]:>8.4f}"
                  f"{told[r.layout] / r.real_s - 1:>+7.1%}  "
                  f"{m.fb_per_mb[0] * 1e3:.1f}/{m.fb_per_mb[1] * 1e3:.1f}{tag}")
        print(f"sim_vs_real_mape {err:.3f} over {', '.join(r.layout for r in rows)}; real runs {wall:.0f} s (mpirun)")
        for name, m in measured.items():  # TP chunks: the part of F+B spent inside TP all-reduces
            if m.parts.get("TP", 0.0) > 0:
                print(f"{name}: {m.parts['TP']:.4f} s per iteration inside TP all-reduces on its slowest rank, "
                      f"{m.parts['TP'] / (m.parts['F'] + m.parts['B']):.0%} of its F+B")
        ring = [2.0 * (n / 2) / cal.link_bw_Bps + 2.0 * cal.link_latency_s for n, _ in probe]
        print("all-reduce over both ranks, real vs the model's ring (2(p-1) latencies + 2(p-1)/p bytes/bw): "
              + ", ".join(f"{n / 1024:.0f} KiB {t * 1e3:.2f} vs {r * 1e3:.2f} ms" for (n, t), r in zip(probe, ring)))
        print(f"machine load before / after the real runs: {load_before} / {load_after}")
        if busy:
            print(f"CPU share of a plain busy loop (no torch): one rank alone {busy['alone']:.2f}, both ranks at once "
                  + " and ".join(f"{x:.2f}" for x in busy["both"]))
        print(f"diagnosis, device calibrated on {BUSY_REFERENCE!r} instead (both ranks busy, "
              f"{cal_busy.device_flops / 1e9:.2f} GFLOP/s): MAPE {mape(rows_busy):.3f}; "
              + ", ".join(f"{r.layout} {r.sim_s:.4f} s ({r.error:+.1%})" for r in rows_busy))
        print("GFLOP/s: the layout's own achieved F/B rate; cpu s: main-thread CPU seconds per iteration;\n"
              "cpu/wall (proc): main-thread (all threads') CPU time "
              "over wall time on its slowest rank;\nsim*/err*: the simulator told that rate (diagnosis only, "
              "fitted per layout)")
    solo = measured[REFERENCE].fb_per_mb
    return {
        "sim_vs_real_mape": round(err, 4),
        "sim_vs_real_reference": REFERENCE,
        "sim_vs_real_by_layout": {r.layout: {"real_s": round(r.real_s, 4), "sim_s": round(r.sim_s, 4),
                                             "error": round(r.error, 4)} for r in rows},
        "sim_vs_real_reference_row": {"real_s": round(ref.real_s, 4), "sim_s": round(ref.sim_s, 4)},
        "sim_vs_real_calibration": {"device_gflops": round(cal.device_flops / 1e9, 3),
                                    "optimizer_mem_gbps": round(cal.device_mem_bw_Bps / 1e9, 3),
                                    "link_gbps": round(cal.link_bw_Bps / 1e9, 3),
                                    "link_latency_us": round(cal.link_latency_s * 1e6, 1)},
        # how much slower a micro-batch's F+B runs with both ranks busy than with one
        "sim_vs_real_fb_slowdown": {n: round(sum(m.fb_per_mb) / sum(solo), 3) for n, m in measured.items()
                                    if n != REFERENCE},
        "sim_vs_real_achieved_gflops": {n: round(m.achieved_flops / 1e9, 3) for n, m in measured.items()},
        "sim_vs_real_cpu_share": {n: round(m.cpu_share, 3) for n, m in measured.items()},
        "sim_vs_real_proc_cpu_share": {n: round(m.proc_share, 3) for n, m in measured.items()},
        # diagnosis: the error left when the simulator is told each layout's own compute rate
        "sim_vs_real_mape_given_compute": round(mape([Row(r.layout, r.real_s, told[r.layout]) for r in rows]), 4),
        "sim_vs_real_allreduce_ms": {f"{int(n) >> 10}KiB": {"real": round(t * 1e3, 3), "model": round(
            (n / cal.link_bw_Bps + 2.0 * cal.link_latency_s) * 1e3, 3)} for n, t in probe},
        "sim_vs_real_mape_ref_busy": round(mape(rows_busy), 4),
        "sim_vs_real_busy_reference": BUSY_REFERENCE,
        "sim_vs_real_by_layout_ref_busy": {r.layout: {"sim_s": round(r.sim_s, 4), "error": round(r.error, 4)}
                                           for r in rows_busy},
        "sim_vs_real_cpu_s_per_iteration": {n: round(m.cpu_s, 4) for n, m in measured.items()},
        "sim_vs_real_busy_loop_cpu_share": (
            {"alone": round(busy["alone"], 3), "both": [round(x, 3) for x in busy["both"]]} if busy else None),
        "sim_vs_real_machine_load": {"before": load_before, "after": load_after},
        "sim_vs_real_steps": steps, "sim_vs_real_wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps per layout (>= 10)")
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    ap.add_argument("--keep", default="", help="copy the real runs' raw records to this directory")
    ap.add_argument("--replay", default="", help="analyse the records kept by an earlier --keep run (no mpirun)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker), [n for n in args.layouts.split(",") if n], args.steps, args.warmup)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    try:
        res = measure(args.steps, args.warmup, keep=args.keep, replay=args.replay)
    except (RuntimeError, ValueError, SpecError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
