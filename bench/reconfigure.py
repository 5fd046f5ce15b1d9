"""Live reconfiguration of a running job vs. checkpoint-restart of the same job.

One ``mpirun -n 4`` job (gloo on loopback) trains a small GPT and switches plan live, once
per reconfiguration kind; per kind the downtime (apply start → every rank ready on the new
plan, max over ranks), the bytes moved, and a lower bound: bytes / measured loopback
bandwidth (best of 3) + measured regroup latency (best of 5) (fresh default group under a new prefix + the plan's
sub-groups). Then checkpoint-restart of the first kind's switch in the same run: the old
job saves its shards (time measured), a fresh ``mpirun`` starts the new layout, loads them
(each rank assembles its new shards from the saved ones) and is ready at the same step.

    python bench/reconfigure.py [--hidden 128] [--layers 8]

Prints a table, then ONE line of JSON: per kind downtime_s, bytes_moved, lower_bound_s,
downtime_over_bound (goal <= 2), each the median of ROUNDS passes over the chain of switches; restart_s and live_vs_restart_speedup (goal >= 5; restart
time over the live downtime of the same switch).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 4
GLOBAL_MB = 8
WARM_STEPS = 2
ROUNDS = 3


def kinds(layers: int) -> list[tuple[str, Any]]:
    """(name, plan) switched to in order, starting from TP2×DP2."""
    from resihp.coordinator.model.plan import PipelinePlan, Plan

    h = layers // 2
    mb = GLOBAL_MB
    return [
        ("tp2dp2->tp4", Plan.uniform(4, 1, 1, layers, mb)),
        ("tp4->tp2pp2", Plan.uniform(2, 2, 1, layers, mb)),
        (f"pp({h},{h})->({h + 1},{h - 1})", Plan(replicas=(PipelinePlan(((0, 1), (2, 3)), (h + 1, h - 1), mb),))),
        ("tp2pp2->pp2dp2", Plan.uniform(1, 2, 2, layers, mb)),
        ("dp_shares(4,4)->(6,2)", Plan(replicas=(PipelinePlan(((0,), (1,)), (h, h), 6),
                                                 PipelinePlan(((2,), (3,)), (h, h), 2)))),
        ("exclude_rank3", Plan(replicas=(PipelinePlan(((0,), (1,)), (h, h), 5), PipelinePlan(((2,),), (layers,), 3)),
                               spares=(3,))),
        ("readmit_rank3", Plan(replicas=(PipelinePlan(((0,), (1,)), (h, h), 4), PipelinePlan(((2,), (3,)), (h, h), 4)))),
    ]


def _setup(hidden: int, layers: int) -> tuple[Any, Any, Any]:
    import torch

    from resihp.coordinator.model.plan import Plan
    from resihp.coordinator.model.spec import ModelSpec
    from resihp.trainer_hooks.runtime.trainer import TrainConfig

    torch.set_num_threads(1)
    spec = ModelSpec("bench-reconf", layers, hidden, 4, 4 * hidden, 256)
    return spec, TrainConfig(seed=5, max_seq_len=64, lr=1e-3), Plan.uniform(2, 1, 2, layers, GLOBAL_MB)


def _max(comm: Any, value: float) -> float:
    return float(max(comm.allgather(value)))


def loopback_bandwidth(comm: Any, rank: int) -> float:
    """Bytes/s of one 32 MiB message rank 0 -> 1 on the default group, best of 3 (every rank calls)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(8 << 20)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        best = min(best, time.perf_counter() - t)
    return float(comm.bcast(buf.numel() * 4 / best if rank == 1 else None, root=1))


class RegroupRounds:
    """Regroup latency: a fresh default group under a new prefix + a plan's sub-groups, 5 rounds
    (a lower bound takes the best the machine has shown). Each round starts once the previous
    round's groups are torn down (a gloo group's destructor waits on its peers; overlapping it
    made later rounds 3-4x slower than the first). Every rank calls, with the same plans."""

    def __init__(self, comm: Any, store: str, rank: int, world: int) -> None:
        self.comm, self.store, self.rank, self.world = comm, store, rank, world
        self.epoch = 0

    def measure(self, plan: Any) -> list[float]:
        import torch.distributed as dist

        from resihp.trainer_hooks.reconfig.world import init_world
        from resihp.trainer_hooks.runtime.groups import make_groups, wait_retired

        lat: list[float] = []
        for _ in range(5):
            self.epoch += 1
            if dist.is_initialized():
                dist.destroy_process_group()  # its teardown here, untimed (init_world would retire it)
            wait_retired(30.0)
            self.comm.Barrier()
            t = time.perf_counter()
            init_world(self.store, self.epoch, self.rank, self.world, 60.0)
            made = make_groups([plan], self.rank)
            dist.barrier()
            lat.append(_max(self.comm, time.perf_counter() - t))
            for g in made.values():  # untimed, like the default group's teardown
                if g is not dist.group.WORLD:
                    dist.destroy_process_group(g)
            del made
        return lat


def worker(out: Path, hidden: int, layers: int) -> None:
    import torch

    from resihp.trainer_hooks.launch.bootstrap import Bootstrap
    from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, optimizer_steps, runtime_shards
    from resihp.trainer_hooks.reconfig.world import init_world
    from resihp.trainer_hooks.runtime.groups import destroy_groups
    from resihp.trainer_hooks.runtime.layout import tensors_of_rank

    spec, config, start = _setup(hidden, layers)
    boot = Bootstrap(timeout_s=120)
    comm, rank = boot.comm, boot.rank
    store = boot.info().store_addr
    boot.init_epoch(0)
    res: dict[str, Any] = {}

    res["loopback_Bps"] = loopback_bandwidth(comm, rank)
    rounds = RegroupRounds(comm, store, rank, WORLD)
    lat = rounds.measure(start)
    res["regroup_s"] = min(lat)
    res["regroup_rounds_s"] = lat
    # the same for each kind's target plan, whose groups the switch builds (a plan with a
    # pipeline has one group more per pair of neighbours): reported beside the headline bound
    res["regroup_target_s"] = {name: min(rounds.measure(plan)) for name, plan in kinds(layers)}

    # live switches
    epoch = rounds.epoch + 1
    init_world(store, epoch, rank, WORLD, 60.0)
    rc = LiveReconfigurer(spec, start, rank, config, store, timeout_s=60.0, epoch=epoch)
    it = 0
    for _ in range(WARM_STEPS):
        rc.train_step(it)
        it += 1
    # checkpoint of the state before the first switch (for the restart measurement)
    comm.Barrier()
    t = time.perf_counter()
    assert rc.runtime is not None
    ckpt = {"iteration": it, "step": optimizer_steps(rc.runtime), "shards": {
        s: {spec_.name: ([(i.start, i.stop) for i in idx], by[spec_.name].clone())
            for spec_, idx in tensors_of_rank(rc.plan, rank, rc.specs)}
        for s, by in runtime_shards(rc.runtime).items()}}
    torch.save(ckpt, out / f"ckpt{rank}.pt")
    os.sync()
    res["save_s"] = _max(comm, time.perf_counter() - t)
    # ROUNDS passes over the chain (each ends by switching back to the start plan); per kind
    # the median pass, since other load on a shared machine stalls single passes at random
    runs: dict[str, list[dict[str, float]]] = {}
    chain = kinds(layers)
    for rnd in range(ROUNDS):
        for name, plan in chain + ([("back_to_start", start)] if rnd < ROUNDS - 1 else []):
            epoch += 1
            # the command reaches the ranks before its apply_at: the (pure) reshard plan is made on receipt
            t = time.perf_counter()
            rc.prepare(plan)
            plan_s = _max(comm, time.perf_counter() - t)
            comm.Barrier()
            st: dict[str, float] = {}
            report = rc.apply(plan, epoch, stats=st)
            runs.setdefault(name, []).append({"exec_s": _max(comm, sum(st.values())),
                "plan_s": plan_s, "downtime_s": _max(comm, report.downtime_s), "bytes_moved": report.bytes_moved,
                "regroup_s": _max(comm, report.regroup_s), "reshard_s": _max(comm, report.reshard_s),
                "rebuild_s": _max(comm, report.rebuild_s)})
            rc.train_step(it)
            it += 1
    live = {name: sorted(r, key=lambda x: x["downtime_s"])[len(r) // 2] for name, r in runs.items()
            if name != "back_to_start"}
    res["live"] = live
    if rc.runtime is not None:
        destroy_groups(rc.runtime.groups)
    if rank == 0:
        (out / "live.json").write_text(json.dumps(res))
    boot.close()


def restart_worker(out: Path, hidden: int, layers: int, t_launch: float) -> None:
    """The restarted job: new layout, state assembled from the saved shards, ready at the same step."""
    import torch

    from resihp.trainer_hooks.launch.bootstrap import Bootstrap
    from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, load_shards
    from resihp.trainer_hooks.runtime.layout import tensors_of_rank

    spec, config, _ = _setup(hidden, layers)
    boot = Bootstrap(timeout_s=120)
    comm, rank = boot.comm, boot.rank
    boot.init_epoch(0)
    plan = kinds(layers)[0][1]
    rc = LiveReconfigurer(spec, plan, rank, config, boot.info().store_addr, timeout_s=60.0)
    saved = [torch.load(out / f"ckpt{r}.pt") for r in range(WORLD)]
    it, step = saved[0]["iteration"], saved[0]["step"]
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for spec_, idx in tensors_of_rank(plan, rank, rc.specs):
        for state in saved[0]["shards"]:
            full = torch.empty(spec_.shape)
            for ck in saved:
                if spec_.name in ck["shards"][state]:
                    bounds, t = ck["shards"][state][spec_.name]
                    full[tuple(slice(a, b) for a, b in bounds)] = t
            shards.setdefault(state, {})[spec_.name] = full[idx].clone()
    assert rc.runtime is not None
    load_shards(rc.runtime, shards, step)
    rc.runtime.data.global_tokens(it)  # the data stream is packed up to the step it resumes at
    comm.Barrier()
    ready = _max(comm, time.time() - t_launch)
    rc.train_step(it)  # it does train from there
    if rank == 0:
        (out / "restart.json").write_text(json.dumps({"ready_s": ready}))
    boot.close()


def _mpirun(args: list[str]) -> list[str]:
    mpirun = str(Path(sys.executable).parent / "mpirun")
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(WORLD),
            "-x", "OMP_NUM_THREADS", sys.executable, __file__, *args]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/reconfigure.py")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worker", choices=("live", "restart"))
    parser.add_argument("--out")
    parser.add_argument("--t-launch", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.layers < 4 or args.layers % 2:
        parser.error("--layers must be an even number >= 4")
    if args.worker == "live":
        worker(Path(args.out), args.hidden, args.layers)
        return 0
    if args.worker == "restart":
        restart_worker(Path(args.out), args.hidden, args.layers, args.t_launch)
        return 0

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subprocess.run(_mpirun(["--worker", "live", "--out", tmp, *size]), env=env, check=True, timeout=200)
        res = json.loads((out / "live.json").read_text())
        t_launch = time.time()
        subprocess.run(_mpirun(["--worker", "restart", "--out", tmp, "--t-launch", repr(t_launch), *size]),
                       env=env, check=True, timeout=200)
        ready = json.loads((out / "restart.json").read_text())["ready_s"]

    bw, regroup = res["loopback_Bps"], res["regroup_s"]
    kinds_out: dict[str, Any] = {}
    rounds = ", ".join(f"{x * 1e3:.0f}" for x in res["regroup_rounds_s"])
    print(f"loopback bandwidth {bw / 1e9:.2f} GB/s; regroup (fresh default group + sub-groups) {regroup * 1e3:.0f} ms "
          f"(best of {rounds} ms)")
    print(f"{'kind':28s} {'MiB moved':>9s} {'plan*':>6s} {'downtime s':>10s} {'regroup':>8s} {'reshard':>8s} "
          f"{'(exec)':>7s} {'rebuild':>8s} {'bound s':>8s} {'ratio':>6s} {'ratio**':>7s}")
    for name, k in res["live"].items():
        bound = k["bytes_moved"] / bw + regroup
        bound_target = k["bytes_moved"] / bw + res["regroup_target_s"][name]
        kinds_out[name] = {"downtime_s": round(k["downtime_s"], 4), "bytes_moved": k["bytes_moved"],
                           "lower_bound_s": round(bound, 4), "plan_ahead_s": round(k["plan_s"], 4),
                           "downtime_over_bound": round(k["downtime_s"] / bound, 2),
                           "lower_bound_target_groups_s": round(bound_target, 4),
                           "downtime_over_target_bound": round(k["downtime_s"] / bound_target, 2)}
        print(f"{name:28s} {k['bytes_moved'] / 2**20:9.2f} {k['plan_s']:6.3f} {k['downtime_s']:10.3f} {k['regroup_s']:8.3f} "
              f"{k['reshard_s']:8.3f} {k['exec_s']:7.3f} {k['rebuild_s']:8.3f} {bound:8.3f} {k['downtime_s'] / bound:6.2f} "
              f"{k['downtime_s'] / bound_target:7.2f}")
    print("* plan: reshard planning on receipt of the command, before apply_at (not part of the downtime)")
    print("ratio: over the bound with the start plan's regroup (the headline); ratio**: with the kind's own target "
          "plan's regroup (its groups are what the switch builds)")
    restart_s = res["save_s"] + ready
    first = next(iter(kinds_out))
    speedup = restart_s / kinds_out[first]["downtime_s"]
    print(f"checkpoint-restart of {first}: save {res['save_s']:.3f} s + fresh mpirun to ready {ready:.3f} s = "
          f"{restart_s:.3f} s; live {kinds_out[first]['downtime_s']:.3f} s -> {speedup:.1f}x")
    print(json.dumps({
        "bench": "reconfigure", "world": WORLD, "hidden": args.hidden, "layers": args.layers,
        "loopback_bytes_per_s": round(bw), "regroup_s": round(regroup, 4),
        "regroup_rounds_s": [round(x, 4) for x in res["regroup_rounds_s"]],
        "regroup_target_s": {n: round(x, 4) for n, x in res["regroup_target_s"].items()}, "kinds": kinds_out,
        "restart_s": round(restart_s, 3), "restart_kind": first, "live_vs_restart_speedup": round(speedup, 2),
        "worst_downtime_over_bound": max(k["downtime_over_bound"] for k in kinds_out.values()),
        "worst_downtime_over_target_bound": max(k["downtime_over_target_bound"] for k in kinds_out.values()),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
