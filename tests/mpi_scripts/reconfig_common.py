"""Shared pieces of the reconfiguration MPI scripts: the tiny job, full-state gathering."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.launch.bootstrap import Bootstrap
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer, optimizer_steps, runtime_shards
from resihp.trainer_hooks.runtime.layout import TensorSpec, tensors_of_rank
from resihp.trainer_hooks.runtime.trainer import TrainConfig

SPEC = ModelSpec("gpt-reconf", num_layers=8, hidden=32, num_heads=4, ffn_hidden=64, vocab=256)
CONFIG = TrainConfig(seed=7, max_seq_len=32, lr=3e-3)
GLOBAL_MB = 8


def gather_full(comm: Any, rc: LiveReconfigurer) -> dict[str, dict[str, np.ndarray]] | None:
    """Every state as full (unsharded) arrays on comm rank 0; None elsewhere.

    Replicas hold identical copies: a disagreement between two holders of the same slice
    raises (it would mean the DP replicas drifted apart)."""
    mine: list[tuple[str, str, tuple[tuple[int, int], ...], np.ndarray]] = []
    if rc.runtime is not None:
        shards = runtime_shards(rc.runtime)
        for spec, idx in tensors_of_rank(rc.plan, rc.rank, rc.specs):
            for state, by_name in shards.items():
                mine.append((state, spec.name, tuple((s.start, s.stop) for s in idx), by_name[spec.name].numpy().copy()))
    step = optimizer_steps(rc.runtime)
    everything = comm.gather((mine, step), root=0)
    if comm.Get_rank() != 0:
        return None
    specs: dict[str, TensorSpec] = {s.name: s for s in rc.specs}
    full: dict[str, dict[str, np.ndarray]] = {}
    seen: dict[tuple[str, str, tuple[tuple[int, int], ...]], np.ndarray] = {}
    steps = set()
    for pieces, st in everything:
        if pieces:
            steps.add(st)
        for state, name, idx, arr in pieces:
            key = (state, name, idx)
            if key in seen:
                if not np.array_equal(seen[key], arr):
                    raise AssertionError(f"replicas disagree on {state} of {name}{idx}")
                continue
            seen[key] = arr
            target = full.setdefault(state, {}).setdefault(name, np.full(specs[name].shape, np.nan, np.float32))
            target[tuple(slice(a, b) for a, b in idx)] = arr
    if len(steps) > 1:
        raise AssertionError(f"ranks disagree on AdamW's step count: {sorted(steps)}")
    full["_step"] = {"step": np.array([steps.pop() if steps else 0.0])}
    return full


def compare(a: dict[str, dict[str, np.ndarray]], b: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Whether two full states are bitwise equal, and the largest absolute difference."""
    bitwise, worst, worst_rel = True, 0.0, 0.0
    if set(a) != set(b):
        return {"bitwise": False, "max_abs": float("inf"), "max_rel": float("inf"), "why": f"{set(a)} != {set(b)}"}
    for state in a:
        for name, x in a[state].items():
            y = b[state][name]
            if np.isnan(x).any() or np.isnan(y).any():
                return {"bitwise": False, "max_abs": float("inf"), "max_rel": float("inf"), "why": f"{state} {name} has holes"}
            bitwise &= x.tobytes() == y.tobytes()
            d = np.abs(x.astype(np.float64) - y.astype(np.float64))
            worst = max(worst, float(d.max()))
            worst_rel = max(worst_rel, float((d / np.maximum(np.abs(y), 1e-3)).max()))
    return {"bitwise": bitwise, "max_abs": worst, "max_rel": worst_rel}


def step_samples(comm: Any, rc: LiveReconfigurer, ids: Sequence[int] | None) -> list[int] | None:
    """Sample ids trained in one step, over all replicas (each replica counted once), on rank 0."""
    replica = rc.plan.position(rc.rank).replica if rc.plan.has_rank(rc.rank) else -1
    got = comm.gather((replica, tuple(ids) if ids is not None else None), root=0)
    if comm.Get_rank() != 0:
        return None
    per_replica: dict[int, tuple[int, ...]] = {}
    for rep, rids in got:
        if rep >= 0 and rids is not None:
            if per_replica.setdefault(rep, rids) != rids:
                raise AssertionError(f"ranks of replica {rep} trained different samples")
    return sorted(i for rids in per_replica.values() for i in rids)


def first_loss(comm: Any, loss: float | None) -> float | None:
    values = comm.gather(loss, root=0)
    if comm.Get_rank() != 0:
        return None
    found = [v for v in values if v is not None]
    if not found or max(found) != min(found):
        raise AssertionError(f"last-stage ranks report different global losses: {found}")
    return found[0]


def set_threads() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


def ft_script_start(size: int) -> tuple[str, str, Any]:
    """The ULFM scripts' start (``SCRIPT OUT``): one thread, the fault-tolerant world of
    ``size`` ranks: (OUT, the store's address, the world)."""
    from resihp.trainer_hooks.launch.bootstrap import STORE_ENV
    from resihp.trainer_hooks.reconfig.ulfm import ft_world

    out = sys.argv[1]
    set_threads()
    world = ft_world()
    if world.size != size:
        raise SystemExit(f"run with {size} ranks, got {world.size}")
    return out, os.environ[STORE_ENV], world


def four_rank_start(default_steps: int) -> tuple[argparse.Namespace, Bootstrap]:
    """The planned-switch scripts' start: --out DIR and --steps N, one thread, a world of 4."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=default_steps)
    args = parser.parse_args()
    set_threads()
    boot = Bootstrap(timeout_s=120)
    if boot.world_size != 4:
        raise SystemExit(f"run with 4 ranks, got {boot.world_size}")
    return args, boot


def report_and_exit(out: str, rank: int, report: dict[str, Any]) -> NoReturn:
    """Write OUT/RANK.json atomically (the test polls for it), then leave without MPI
    finalisation, which can hang after a failure (the test ends mpirun)."""
    tmp = os.path.join(out, f".{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(out, f"{rank}.json"))
    os._exit(0)


def reference_losses(comm: Any, store: str, plan: Any, steps: int) -> list[float | None]:
    """Every step's global loss of an uninterrupted run of ``plan`` in epoch 0 of this world (the
    reference a resilient run is compared with), known on every rank; its groups are released."""
    from resihp.trainer_hooks.reconfig.world import init_world
    from resihp.trainer_hooks.runtime.groups import destroy_groups

    init_world(store, 0, comm.Get_rank(), comm.Get_size(), 120.0)
    ref = LiveReconfigurer(SPEC, plan, comm.Get_rank(), CONFIG, store, timeout_s=120.0)
    mine = [r.loss if r else None for r in (ref.train_step(s) for s in range(steps))]
    gathered = comm.allgather(mine)
    assert ref.runtime is not None
    destroy_groups(ref.runtime.groups)
    return [next((v[i] for v in gathered if v[i] is not None), None) for i in range(steps)]


def start_resilient(tx: Any, plan: Any) -> tuple[Any, Any]:
    """``hooks.init`` of the tiny job on ``plan`` (epoch 1), resilient, with the scripted agent
    transport ``tx`` (which learns the job, to time its commands by boundary): (job, resilience)."""
    from dataclasses import replace

    from resihp.trainer_hooks import hooks

    job = hooks.init(SPEC, replace(plan, epoch=1), config=CONFIG, transport=tx, trace="", resilient=True,
                     failure_timeout_s=5.0)
    tx.job = job
    assert job.resilience is not None
    return job, job.resilience


def train_records(job: Any, res: Any, steps: int) -> list[dict[str, Any]]:
    """Run the resilient loop to ``steps``: one record per step this rank trained (no failures
    expected: a rolled-back step would stay recorded)."""
    records: list[dict[str, Any]] = []
    for it in job.iterations(steps):
        r = job.train_step(it)
        if r is not None:
            records.append({"step": it, "epoch": res.rc.epoch, "loss": r.loss, "samples": list(r.sample_ids)})
        job.step(r)
    return records


class ScriptedAgent:
    """The agent's side of the hooks for a script: acknowledgements are kept, reports and probes
    dropped; a subclass says which commands each poll returns (``poll_commands``)."""

    def __init__(self) -> None:
        self.job: Any = None  # set by start_resilient: polls are timed by the job's boundary
        self.acks: list[tuple[int, int, bool, str]] = []

    def report(self, *args: object, **kwargs: object) -> bool:
        return True

    def probe(self, probe_s: float) -> None:  # compute probes are the agent's business
        return None

    def ack(self, command: Any, iteration: int, ok: bool = True, error: str = "") -> None:
        self.acks.append((command.seq, iteration, ok, error))

    def close(self) -> None:
        pass
