"""What the authenticated store costs against torch's TCPStore (issue #27, item 3).

For each store (``tcpstore``: torch's, unauthenticated; ``authstore``: resihp's
launch/store_server.py + store_client.AuthStore), in its own process: the round-trip time of
one ``set`` + ``get`` from one client, and the time 8 ranks (processes) take to build a gloo
group through it, a fresh prefix per group as every plan epoch does (median of 5 groups per
run, the slowest rank counted). The two kinds alternate, ``--rounds`` times.

    python bench/store_auth.py [--ranks 8] [--rounds 3]

Prints a table, then one line of JSON: ``gloo_group_s_tcpstore``, ``gloo_group_s_authstore``,
``roundtrip_us_tcpstore``, ``roundtrip_us_authstore`` (medians over rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

GROUPS = 5
ROUND_TRIPS = 500


def _client(kind: str, port: int) -> Any:
    import torch.distributed as dist

    from resihp.trainer_hooks.launch.store_client import connect

    if kind == "tcpstore":
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # pyright: ignore[reportPrivateImportUsage]  # public, not re-exported in its stub
    return connect(f"127.0.0.1:{port}", timedelta(seconds=60))


def worker(kind: str, port: int, rank: int, world: int, round_: int) -> None:
    import torch.distributed as dist

    store = _client(kind, port)
    times = []
    for g in range(GROUPS):
        store.add(f"r{round_}/go{g}", 1)  # start together: the slowest rank's time is the group's
        if rank == 0:
            _release(store, f"r{round_}/go{g}", f"r{round_}/all{g}", world)
        else:
            store.wait([f"r{round_}/all{g}"])
        t = time.perf_counter()
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"r{round_}/epoch{g}", store), rank, world,  # type: ignore[attr-defined]
                                   timedelta(seconds=60))
        times.append(time.perf_counter() - t)
        del pg
    rtt = []
    if rank == 0:
        for i in range(ROUND_TRIPS):
            t = time.perf_counter()
            store.set(f"r{round_}/k{i}", b"x" * 64)
            store.get(f"r{round_}/k{i}")
            rtt.append(time.perf_counter() - t)
    print(json.dumps({"groups": times, "rtt": rtt}), flush=True)


def _release(store: Any, counter: str, done: str, world: int) -> None:
    while int(store.add(counter, 0)) < world:
        time.sleep(0.001)
    store.set(done, "1")


def serve(kind: str) -> tuple[subprocess.Popen[str], int, dict[str, str]]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    if kind == "tcpstore":
        code = ("import json, sys, torch.distributed as d; from datetime import timedelta; "
                "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)); "
                "print(json.dumps({'port': s.port}), flush=True); sys.stdin.read()")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    else:
        env["RESIHP_RANK_TOKEN"] = "bench-credential"
        proc = subprocess.Popen([sys.executable, "-m", "resihp.trainer_hooks.launch.store_server"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(json.loads(proc.stdout.readline())["port"]), env


def one_run(kind: str, ranks: int, round_: int) -> tuple[float, float]:
    server, port, env = serve(kind)
    try:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, str(port), str(r), str(ranks), str(round_)],
                                  env=env, stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    per_group = [max(o["groups"][g] for o in outs) for g in range(GROUPS)]
    return statistics.median(per_group), statistics.median(outs[0]["rtt"])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        kind, port, rank, world, round_ = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
        worker(kind, port, rank, world, round_)
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    got: dict[str, list[tuple[float, float]]] = {"tcpstore": [], "authstore": []}
    print(f"{'store':10s} {'round':>5s} {'gloo group of ' + str(a.ranks) + ' (s)':>22s} {'set+get (us)':>14s}")
    for r in range(a.rounds):
        for kind in ("tcpstore", "authstore"):
            group_s, rtt_s = one_run(kind, a.ranks, r)
            got[kind].append((group_s, rtt_s))
            print(f"{kind:10s} {r:5d} {group_s:22.3f} {rtt_s * 1e6:14.0f}", flush=True)
    out = {"ranks": a.ranks, "rounds": a.rounds}
    for kind, rows in got.items():
        out[f"gloo_group_s_{kind}"] = round(statistics.median(g for g, _ in rows), 4)
        out[f"roundtrip_us_{kind}"] = round(statistics.median(t for _, t in rows) * 1e6, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
