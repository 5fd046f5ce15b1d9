"""Can two ranks share one GPU over NCCL here? ``bench/gpu_check.sh`` asks before it picks a backend.

    python bench/nccl_share_probe.py      # prints a table, then one JSON line

Two processes, one TCPStore on loopback, both on CUDA device 0, one ``all_reduce`` of a
CUDA tensor. NCCL >= 2.5 refuses this ("Duplicate GPU detected"); the probe records what
this NCCL says rather than assuming it, so a later NCCL that allows it is noticed.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import subprocess
import sys
from typing import Any

TIMEOUT_S = 60


def _child(rank: int, port: int) -> int:
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), timeout=_dt.timedelta(seconds=30))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=_dt.timedelta(seconds=30))
        x = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        print(json.dumps({"rank": rank, "ok": True, "sum": x.tolist()}), flush=True)
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the refusal is the answer this probe is after
        print(json.dumps({"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}), flush=True)
        return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        rank, port = (int(v) for v in sys.argv[2].split(":"))
        return _child(rank, port)
    port = _free_port()
    env = {**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", f"{r}:{port}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    results: list[dict[str, Any]] = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results.append({"rank": r, "ok": False, "error": f"no answer in {TIMEOUT_S} s"})
            continue
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"rank": r, "ok": False, "error": out[-600:]})
        warn = [ln.strip() for ln in out.splitlines() if "NCCL WARN" in ln]
        if warn:
            results[-1]["nccl_warn"] = warn[0][-300:]
    works = all(r.get("ok") and r.get("sum") == [3.0] * 4 for r in results)
    print(f"{'rank':>4}  {'ok':>5}  detail")
    for r in results:
        print(f"{r['rank']:>4}  {str(r.get('ok')):>5}  {r.get('sum') or r.get('nccl_warn') or r.get('error')}")
    print(json.dumps({"nccl_ranks_share_gpu": works, "ranks": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
