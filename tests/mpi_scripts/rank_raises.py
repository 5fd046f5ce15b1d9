"""A resilient job (the runtime's GPT, PP2 x DP2) whose loop raises on one rank at one step:
the rank fails as an uncaught exception; the survivors must recover and finish. With ``stop``
the rank stops itself instead (SIGSTOP: alive, silent, its peers blocked on it), for good: the
coordinator must declare it dead and its agent fence it.

Usage (under ``resihp launch -n 4``): rank_raises.py STEPS RANK AT [raise|stop]
"""
from __future__ import annotations

import os
import signal
import sys

import resihp.trainer_hooks as hooks
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.trainer_hooks.runtime.trainer import TrainConfig

steps, raise_rank, raise_at = (int(x) for x in sys.argv[1:4])
mode = sys.argv[4] if len(sys.argv) > 4 else "raise"
spec = preset("gpt-tiny")
job = hooks.init(spec, Plan.uniform(1, 2, 2, spec.num_layers, 8), config=TrainConfig(max_seq_len=64))
for it in job.iterations(steps):
    job.step(job.train_step(it))
    if job.rank == raise_rank and it == raise_at and mode == "stop":
        print(f"rank {job.rank} stops itself (SIGSTOP) after step {it}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif job.rank == raise_rank and it == raise_at:
        raise RuntimeError(f"the user's loop fails on rank {job.rank} after step {it}")
failed = job.resilience is not None and job.resilience.failures > 0
job.close()
if failed:  # after a peer died MPI's finalisation can hang
    sys.stdout.flush()
    os._exit(0)
