"""A user's model (tests/usermodel_models.py) on replicas of different TP sizes, against one process.

Usage (4 ranks): mpirun -n 4 python tests/mpi_scripts/usermodel_mixed_tp.py --out DIR --model nanogpt

Phase 0: a TP2 replica (ranks 0, 1) beside a TP1 replica whose pipeline has two stages
(ranks 2, 3), STEPS steps: every layer, the tied embedding / head too, is held on TP2 by one
replica and TP1 by the other (runtime/groups.mixed_tp_sizes). Phase 1: rank 0 alone runs the
same job (same seed, same data) on one process. Rank 0 writes DIR/MODEL.json with both loss
curves.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the user models

from usermodel_models import LAYERS, SEQ, recipe  # noqa: E402

from resihp.coordinator.model.plan import PipelinePlan, Plan  # noqa: E402
from resihp.trainer_hooks.launch.bootstrap import Bootstrap  # noqa: E402
from resihp.trainer_hooks.runtime.groups import destroy_groups  # noqa: E402
from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig  # noqa: E402

STEPS = 12
CONFIG = TrainConfig(seed=3, max_seq_len=SEQ, lr=3e-3)
MIXED = Plan(replicas=(PipelinePlan(((0, 1),), (LAYERS,), 2), PipelinePlan(((2,), (3,)), (2, LAYERS - 2), 2)))
SINGLE = Plan(replicas=(PipelinePlan(((0,),), (LAYERS,), 4),))


def losses(boot: Bootstrap, name: str, plan: Plan, epoch: int) -> list[float | None]:
    boot.init_epoch(epoch)
    if not plan.has_rank(boot.rank):
        return []
    rec = recipe(name)
    rt = Runtime(rec.spec, plan, boot.rank, CONFIG, epoch=epoch, recipe=rec)
    out = [rt.train_step(step).loss for step in range(STEPS)]
    destroy_groups(rt.groups)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nanogpt")
    args = ap.parse_args()
    torch.set_num_threads(1)
    boot = Bootstrap(timeout_s=120)
    mixed = losses(boot, args.model, MIXED, 0)
    # the loss is the global one on every last-stage rank: rank 0 takes it from rank 3 (or its own)
    mixed = boot.comm.bcast(mixed, root=3)
    single = losses(boot, args.model, SINGLE, 1)
    if boot.rank == 0:
        (Path(args.out) / f"{args.model}.json").write_text(json.dumps({"mixed": mixed, "single": single}))
    boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
