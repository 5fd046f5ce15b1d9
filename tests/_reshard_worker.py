"""One rank of the transfer-executor test: runs every scenario on real gloo groups.

Usage: _reshard_worker.py RANK WORLD STORE_PORT OUT_JSON. Every rank derives the same full
tensors from a seed, holds its old shards, runs the executor, and writes per scenario
whether its new shards equal the full tensors sliced under the new plan, bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.reconfig.pieces import TransferError
from resihp.trainer_hooks.reconfig.reshard import STATES, Transfer, plan_reshard
from resihp.trainer_hooks.reconfig.transfer import execute_reshard
from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure
from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs, tensors_of_rank

MODEL = ModelSpec("t", num_layers=4, hidden=16, num_heads=4, ffn_hidden=32, vocab=24)
SPECS = gpt_tensor_specs(MODEL, max_seq_len=8)
NODES = {0: "a", 1: "a", 2: "b", 3: "b"}

# name -> (old plan, new plan, alive ranks in process-group order)
SCENARIOS: dict[str, tuple[Plan, Plan, list[int]]] = {
    "tp2pp2_to_tp4": (Plan.uniform(2, 2, 1, 4, 4), Plan.uniform(4, 1, 1, 4, 4), [0, 1, 2, 3]),
    "pp4_to_pp2dp2": (Plan.uniform(1, 4, 1, 4, 4), Plan.uniform(1, 2, 2, 4, 4, ranks=[3, 2, 1, 0]), [0, 1, 2, 3]),
    # rank 1 is dead: its TP shard comes from replica 1; stages get different TP sizes
    "dead_rank_hetero": (
        Plan.uniform(2, 1, 2, 4, 4),
        Plan(replicas=(PipelinePlan(((3,), (0, 2)), (1, 3), 4),)),
        [0, 2, 3],
    ),
    "corrupt": (Plan.uniform(2, 2, 1, 4, 4), Plan.uniform(4, 1, 1, 4, 4), [0, 1, 2, 3]),
    "corrupt_crc32": (Plan.uniform(1, 2, 2, 4, 4), Plan.uniform(2, 2, 1, 4, 4), [0, 1, 2, 3]),
    # last: rank 3 dies as the reshard starts; the others must fail fast and recognisably
    "peer_dies": (Plan.uniform(2, 2, 1, 4, 4), Plan.uniform(4, 1, 1, 4, 4), [0, 1, 2, 3]),
}
DYING_RANK, DEATH_CODE = 3, 17


def full_tensors(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {s: {spec.name: torch.randn(spec.shape, generator=gen) for spec in SPECS} for s in STATES}


def corrupted_first_piece(name: str) -> Transfer | None:
    """The piece rank 0 corrupts in a 'corrupt*' scenario: its first remote one."""
    old, new, alive = SCENARIOS[name]
    plan = plan_reshard(old, new, SPECS, alive, NODES)
    return next((t for t in plan.transfers if t.src == 0 and not t.is_local), None)


def run(rank: int, world: int, port: int, out: str) -> dict[str, Any]:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=90))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    full = full_tensors(seed=1234)
    results: dict[str, Any] = {}
    for name, (old, new, alive) in SCENARIOS.items():
        if rank not in alive:
            results[name] = {"skipped": True}
            continue
        pg_rank_of = {r: i for i, r in enumerate(alive)}
        # ranks may reach a scenario far apart on a loaded machine: a long group timeout,
        # and a short one on the reshard's own messages where a peer dies
        pg = dist.ProcessGroupGloo(PrefixStore(name, store), pg_rank_of[rank], len(alive), timedelta(seconds=90))
        plan = plan_reshard(old, new, SPECS, alive, NODES)
        old_shards = {s: {spec.name: full[s][spec.name][idx].clone() for spec, idx in tensors_of_rank(old, rank, SPECS)} for s in STATES}
        bad = corrupted_first_piece(name) if name.startswith("corrupt") else None

        def fault(t: Transfer, buf: torch.Tensor, bad: Transfer | None = bad) -> None:
            if t == bad:
                buf[0] ^= 0x01  # one flipped bit in flight

        if name == "peer_dies":
            # die only once every survivor has its group (a gloo barrier could itself break)
            if rank == DYING_RANK:
                store.wait([f"{name}/ready/{r}" for r in alive if r != rank], timedelta(seconds=90))
                save(results, out)
                os._exit(DEATH_CODE)
            store.set(f"{name}/ready/{rank}", "1")
        try:
            got = execute_reshard(
                plan, rank, old_shards, new, SPECS, pg, pg_rank_of=pg_rank_of, fault=fault,
                checksum="crc32" if name.endswith("crc32") else "sum64",
                timeout=timedelta(seconds=3) if name == "peer_dies" else None,
            )
        except TransferError as exc:
            results[name] = {"error": str(exc), "peer_failure": is_peer_failure(exc)}
        else:
            expected = {spec.name: idx for spec, idx in tensors_of_rank(new, rank, SPECS)}
            equal = all(
                torch.equal(got[s][n], full[s][n][idx]) for s in STATES for n, idx in expected.items()
            ) and all(set(got[s]) == set(expected) for s in STATES)
            results[name] = {"equal": equal, "tensors": len(expected), "sent": plan.send_bytes.get(rank, 0)}
        if name != "peer_dies":
            # a barrier so no rank tears its group down while a peer still reads from it
            pg.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's Backend stub omits the binding's barrier
    return results


def save(results: dict[str, Any], out: str) -> None:
    with open(out, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    rank_, world_, port_, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    save(run(rank_, world_, port_, out), out)
