"""The two calls in one plain process (an MPI world of one), no agent, a throttle from the env.

    RESIHP_THROTTLE=0:3.0@2 python tests/mpi_scripts/hooks_smoke.py OUT_DIR
Writes OUT_DIR/trace.jsonl (through the hooks) and OUT_DIR/summary.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import resihp.trainer_hooks as hooks
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.runtime.trainer import TrainConfig

SPEC = ModelSpec("gpt-smoke", num_layers=2, hidden=32, num_heads=4, ffn_hidden=64, vocab=256)


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    plan = Plan.uniform(1, 1, 1, SPEC.num_layers, 4)
    job = hooks.init(SPEC, plan, config=TrainConfig(seed=3, max_seq_len=32), trace=str(out / "trace.jsonl"),
                     trace_every=2, job="smoke")
    assert job.runtime is not None
    factors, losses = [], []
    for it in range(5):
        result = job.runtime.train_step(it)
        factors.append(job.throttle.factor)  # the factor this iteration ran with
        losses.append(result.loss)
        hooks.step(job, result)
    job.close()
    (out / "summary.json").write_text(json.dumps({"factors": factors, "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
