"""Run several layouts of the same training job in ONE mpirun world and record the losses.

Usage (8 ranks): mpirun -n 8 python tests/mpi_scripts/equivalence.py --out DIR --steps 30
   reference:    python tests/mpi_scripts/equivalence.py --reference --out DIR --steps 30

Phases (each a fresh plan epoch, so each gets fresh groups and store prefix):
  0: TP2×PP2×DP2 on ranks 0–7
  1: TP2×PP2 on ranks 0–3   |  PP4 on ranks 4–7
  2: DP4 on ranks 0–3       |  DP4 with unequal shares (3, 0, 4, 1) on ranks 4–7
  3: TP4 and TP2 replicas on ranks 0–5 | PP2 on ranks 6–7
  4: TP2 and TP1 replicas on ranks 0–2 | TP2×PP2-stage replica (stage 1 on TP1) and PP2 on ranks 3–7
  5: PP4 on ranks 0–3, traced to DIR/healthy.jsonl           (ranks 4–7 wait)
  6: PP4 on ranks 4–7, traced to DIR/throttled.jsonl; rank 6 (trace rank 2, stage 2)
     is throttled ×THROTTLE from iteration THROTTLE_AT on      (ranks 0–3 wait)
The last-stage, TP-rank-0 rank of replica 0 of each layout writes DIR/<layout>.json.
Traces number ranks 0–3 (the sub-job's own ranks), as a 4-rank job's trace would.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.launch.bootstrap import Bootstrap
from resihp.trainer_hooks.reporting.trace_writer import RankIteration, TraceCollector, make_header
from resihp.trainer_hooks.runtime.groups import destroy_groups, make_groups
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

SPEC = ModelSpec("gpt-eq", num_layers=4, hidden=32, num_heads=4, ffn_hidden=64, vocab=256)
GLOBAL_MB = 8
CONFIG = TrainConfig(seed=7, max_seq_len=32, lr=3e-3)
# the traced runs use longer compute chunks (~8 ms F, ~18 ms B per micro-batch), so that
# scheduler jitter on a shared CPU is small next to the compute the detector judges
TRACE_SPEC = ModelSpec("gpt-trace", num_layers=4, hidden=128, num_heads=4, ffn_hidden=512, vocab=256)
# compute timed in CPU time and a throttle that burns CPU time: the detector then judges this
# job's own compute, not the other jobs sharing the machine's two cores (docs/runtime.md)
TRACE_CONFIG = TrainConfig(seed=11, max_seq_len=128, lr=1e-3, compute_clock="cpu")
TRACE_STEPS = 24
THROTTLE, THROTTLE_AT, THROTTLED_RANK = 2.0, 12, 6


def unequal_dp(ranks: list[int], shares: list[int]) -> Plan:
    reps = tuple(PipelinePlan(stages=((r,),), layers=(SPEC.num_layers,), microbatches=s) for r, s in zip(ranks, shares))
    return Plan(replicas=reps)


def layouts_for(rank: int, world: int) -> list[tuple[str, Plan, list[Plan]]]:
    """(name, plan, the plans of the other ranks in the same phase) for each phase."""
    u = Plan.uniform
    L = SPEC.num_layers
    if world == 1:
        return [("single", u(1, 1, 1, L, GLOBAL_MB), [])]
    if world != 8:
        raise SystemExit(f"run with 8 ranks (or 1 for --reference), got {world}")
    phases = [
        [("tp2pp2dp2", u(2, 2, 2, L, GLOBAL_MB))],
        [("tp2pp2", u(2, 2, 1, L, GLOBAL_MB, ranks=range(4))), ("pp4", u(1, 4, 1, L, GLOBAL_MB, ranks=range(4, 8)))],
        [("dp4", u(1, 1, 4, L, GLOBAL_MB, ranks=range(4))), ("dp4_unequal", unequal_dp([4, 5, 6, 7], [3, 0, 4, 1]))],
        # replicas that split the same layers over different TP sizes (groups.mixed_tp_sizes):
        # halves summed over TP4 and TP2 holders; whole tensors over TP2 and TP1 ones
        [("mixed_tp4_tp2", Plan(replicas=(PipelinePlan(((0, 1, 2, 3),), (L,), 4), PipelinePlan(((4, 5),), (L,), 4)))),
         ("pp2", u(1, 2, 1, L, GLOBAL_MB, ranks=range(6, 8)))],
        [("mixed_tp", Plan(replicas=(PipelinePlan(((0, 1),), (L,), 4), PipelinePlan(((2,),), (L,), 4)))),
         ("mixed_tp_stages", Plan(replicas=(PipelinePlan(((3, 4), (5,)), (2, L - 2), 4),
                                            PipelinePlan(((6,), (7,)), (2, L - 2), 4))))],
    ]
    out = []
    for phase in phases:
        mine = [(n, p) for n, p in phase if p.has_rank(rank)][0]
        out.append((mine[0], mine[1], [p for _, p in phase if p is not mine[1]]))
    return out


def traced_phase(boot: Bootstrap, out: Path, sub: int, epoch: int) -> None:
    """PP4 on ranks 4·sub … 4·sub+3 with a trace; the other four ranks only join the groups."""
    first = 4 * sub
    plan = Plan.uniform(1, 4, 1, TRACE_SPEC.num_layers, GLOBAL_MB, ranks=range(first, first + 4))
    member = plan.has_rank(boot.rank)
    comm = boot.comm.Split(0 if member else 1, boot.rank)
    if not member:
        make_groups([plan], boot.rank)
        comm.Free()
        return
    throttle = Throttle(mode="spin", clock=time.thread_time)
    rt = Runtime(TRACE_SPEC, plan, boot.rank, TRACE_CONFIG, throttle=throttle, epoch=epoch)
    local = comm.Get_rank()
    job_start = comm.bcast(time.time() if local == 0 else None, root=0)
    name = "healthy" if sub == 0 else "throttled"
    trace_plan = Plan.uniform(1, 4, 1, TRACE_SPEC.num_layers, GLOBAL_MB)
    fh = open(out / f"{name}.jsonl", "w", encoding="utf-8") if local == 0 else None
    header = make_header(TRACE_SPEC, trace_plan, ("node0",) * 4, name, TRACE_CONFIG.budget, {"source": "equivalence"}) if fh else None
    collector = TraceCollector(comm, local, 0, trace_plan, every=10, out=fh, header=header)
    for step in range(TRACE_STEPS):
        if sub == 1 and boot.rank == THROTTLED_RANK and step == THROTTLE_AT:
            throttle.set_factor(THROTTLE)
        r = rt.train_step(step)
        collector.record(RankIteration(local, step, 0, r.wall_start_s - job_start, r.time_s, r.seqlens, tuple(r.chunks)))
    collector.close()
    if fh:
        fh.close()
    destroy_groups(rt.groups)
    comm.Free()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--skip-equivalence", action="store_true", help="only the traced phases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    boot = Bootstrap(timeout_s=120)
    out = Path(args.out)
    epoch = 0
    phases = [] if args.skip_equivalence else layouts_for(boot.rank, boot.world_size)
    for name, plan, others in phases:
        boot.init_epoch(epoch)
        rt = Runtime(SPEC, plan, boot.rank, CONFIG, epoch=epoch, cohabitants=others)
        start = time.perf_counter()
        losses = [rt.train_step(step).loss for step in range(args.steps)]
        if boot.rank in (0, 4):
            print(f"{time.strftime('%H:%M:%S')} rank {boot.rank} {name}: {args.steps} steps in "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
        place = rt.groups.place
        if place.last and place.tp_index == 0 and place.replica == 0:
            (out / f"{name}.json").write_text(json.dumps({"layout": name, "plan": plan.to_dict(), "losses": losses}))
        destroy_groups(rt.groups)
        epoch += 1
    if boot.world_size == 8:
        for sub in (0, 1):
            boot.init_epoch(epoch)
            traced_phase(boot, out, sub, epoch)
            epoch += 1
    boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
