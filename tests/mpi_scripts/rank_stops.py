"""A resilient job (the runtime's GPT, PP2 x DP2) one of whose ranks stops itself (SIGSTOP:
alive, silent, holding its peers up) after one step, for good: the coordinator must declare it
dead, its agent fence it (SIGKILL), and the survivors recover and finish every step.

Usage (under ``resihp launch -n 4``): rank_stops.py STEPS STOP_RANK STOP_AT
"""
from __future__ import annotations

import os
import signal
import sys

import resihp.trainer_hooks as hooks
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.trainer_hooks.runtime.trainer import TrainConfig

steps, stop_rank, stop_at = (int(x) for x in sys.argv[1:4])
spec = preset("gpt-tiny")
job = hooks.init(spec, Plan.uniform(1, 2, 2, spec.num_layers, 8), config=TrainConfig(max_seq_len=64))
for it in job.iterations(steps):
    job.step(job.train_step(it))
    if job.rank == stop_rank and it == stop_at:
        print(f"rank {job.rank} stops itself (SIGSTOP) after step {it}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
failed = job.resilience is not None and job.resilience.failures > 0
job.close()
if failed:  # after a peer died MPI's finalisation can hang
    sys.stdout.flush()
    os._exit(0)
