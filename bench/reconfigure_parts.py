"""Bytes moved and wall time of the transfer executor for a few reconfiguration kinds.

Four gloo processes on loopback (store hosted in this process) run, per kind, the reshard
plan of a small GPT with its AdamW state (3 fp32 tensors per parameter). Also measured:
loopback point-to-point bandwidth (one 64 MiB message, best of 3) and the latency of
building a fresh gloo group under a new store prefix (what a regroup costs).

    python bench/reconfigure_parts.py [--hidden 256] [--layers 8]

Prints a table, then one JSON line. ``lower_bound_s`` = bytes moved / loopback bandwidth;
``time_over_bound`` = executor time / that bound.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD = 4


def kinds(layers: int) -> dict[str, tuple[Any, Any, list[int]]]:
    from resihp.coordinator.model.plan import PipelinePlan, Plan

    half = layers // 2
    return {
        "tp4->tp2dp2": (Plan.uniform(4, 1, 1, layers, 8), Plan.uniform(2, 1, 2, layers, 8), [0, 1, 2, 3]),
        "tp2dp2->tp4": (Plan.uniform(2, 1, 2, layers, 8), Plan.uniform(4, 1, 1, layers, 8), [0, 1, 2, 3]),
        f"pp({half},{half})->({half + 1},{half - 1})": (
            Plan.uniform(2, 2, 1, layers, 8),
            Plan(replicas=(PipelinePlan(((0, 1), (2, 3)), (half + 1, half - 1), 8),)),
            [0, 1, 2, 3],
        ),
        "pp4->pp2dp2": (Plan.uniform(1, 4, 1, layers, 8), Plan.uniform(1, 2, 2, layers, 8), [0, 1, 2, 3]),
        "lost_rank1(tp2dp2->tp2,spare3)": (
            Plan.uniform(2, 1, 2, layers, 8), Plan.uniform(2, 1, 1, layers, 8, ranks=[0, 2]), [0, 2, 3],
        ),
    }


def worker(rank: int, port: int, hidden: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    from resihp.coordinator.model.spec import ModelSpec
    from resihp.trainer_hooks.reconfig.reshard import STATES, plan_reshard
    from resihp.trainer_hooks.reconfig.transfer import execute_reshard
    from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs, shard_shape, tensors_of_rank

    torch.set_num_threads(1)
    specs = gpt_tensor_specs(ModelSpec("bench", layers, hidden, 8, 4 * hidden, 8 * hidden), 256)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    out: dict[str, Any] = {}

    t0 = time.perf_counter()
    pg = dist.ProcessGroupGloo(PrefixStore("bw", store), rank, WORLD, timedelta(seconds=120))
    pg.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
    out["regroup_s"] = time.perf_counter() - t0
    buf = torch.ones(64 << 18)  # 64 MiB of float32
    best = float("inf")
    for _ in range(3):
        pg.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
        t0 = time.perf_counter()
        if rank == 0:
            pg.send([buf], 1, 0).wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's send
        elif rank == 1:
            pg.recv([buf], 0, 0).wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's recv
        pg.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
        best = min(best, time.perf_counter() - t0)
    out["bandwidth_Bps"] = buf.numel() * 4 / best

    for name, (old, new, alive) in kinds(layers).items():
        if rank not in alive:
            continue
        pg_rank_of = {r: i for i, r in enumerate(alive)}
        sub = dist.ProcessGroupGloo(PrefixStore(name, store), pg_rank_of[rank], len(alive), timedelta(seconds=120))
        plan = plan_reshard(old, new, specs, alive)
        old_shards = {s: {spec.name: torch.randn(shard_shape(idx)) for spec, idx in tensors_of_rank(old, rank, specs)}
                      for s in STATES}
        sub.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
        t0 = time.perf_counter()
        parts: dict[str, float] = {}
        execute_reshard(plan, rank, old_shards, new, specs, sub, pg_rank_of=pg_rank_of, stats=parts)
        sub.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
        out[name] = {"time_s": time.perf_counter() - t0, "bytes_moved": plan.bytes_moved, **parts,
                     "max_send_bytes": plan.max_send_bytes, "transfers": len(plan.transfers)}
    print(json.dumps(out), flush=True)


def main(argv: list[str]) -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.hidden, args.layers)
        return 0

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--port", str(store.port)]
    procs = [subprocess.Popen(cmd + ["--worker", str(r)], stdout=subprocess.PIPE, text=True) for r in range(WORLD)]
    results = []
    try:
        for p in procs:
            results.append(json.loads(p.communicate(timeout=170)[0].strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bw = results[0]["bandwidth_Bps"]
    regroup = max(r["regroup_s"] for r in results)
    summary: dict[str, Any] = {"loopback_bandwidth_Bps": round(bw), "regroup_s": round(regroup, 4),
                               "hidden": args.hidden, "layers": args.layers, "kinds": {}}
    print(f"loopback bandwidth {bw / 1e9:.2f} GB/s, fresh gloo group of {WORLD}: {regroup * 1e3:.1f} ms")
    print(f"{'kind':34} {'moved MiB':>10} {'max send MiB':>13} {'time s':>8} {'bound s':>8} {'time/bound':>10}"
          f" {'pack s':>7} {'wire s':>7} {'unpack s':>8}")
    for name in kinds(args.layers):
        per_rank = [r[name] for r in results if name in r]
        t = max(x["time_s"] for x in per_rank)
        moved, max_send = per_rank[0]["bytes_moved"], per_rank[0]["max_send_bytes"]
        bound = max(moved / bw, 1e-9)
        part = {k: round(max(x[k] for x in per_rank), 4) for k in ("pack_s", "wire_s", "unpack_s")}
        summary["kinds"][name] = {"bytes_moved": moved, "max_send_bytes": max_send, "time_s": round(t, 4),
                                  "lower_bound_s": round(bound, 4), "time_over_bound": round(t / bound, 2), **part}
        print(f"{name:34} {moved / 2**20:10.1f} {max_send / 2**20:13.1f} {t:8.3f} {bound:8.3f} {t / bound:10.2f}"
              f" {part['pack_s']:7.3f} {part['wire_s']:7.3f} {part['unpack_s']:8.3f}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
