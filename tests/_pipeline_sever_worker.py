"""One rank of the pipeline-sever test (tests/test_pipeline_sever.py).

Usage: _pipeline_sever_worker.py RANK STORE_PORT OUT_JSON [pipeline|world]. Three ranks.

``pipeline`` (default): stage 0 is the TP pair
(0, 1), stage 1 is rank 2, four micro-batches. Rank 1 SIGKILLs itself in its third TP
all-reduce: stage 0's second forward. By then rank 0 has sent micro-batch 0's activations to
rank 2 (the send's work is still outstanding), and rank 2 has run micro-batch 0 and is
blocked receiving micro-batch 1 from rank 0. Rank 0's step fails in the all-reduce with its
dead partner; it lets go of its groups as the resilient loop does (``Runtime.let_go_of_groups``
+ ``retire``); rank 2's receive must then fail at once. Ranks 0 and 2 write how long their
step took to fail and the error they saw.

``world``: DP3 over the whole world, rank 0's replica one micro-batch, the others three (a
document-share or mixed-TP plan gives a fast replica fewer). Rank 0 finishes its micro-batch
and blocks in the DP all-reduce. Ranks 1 and 2 never train: they leave the step as a rank
told of a death does, letting go of their groups. Rank 0's all-reduce must then fail at
once: its group is the job's own, whose connections close, not the default group.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec
from resihp.trainer_hooks.runtime.groups import retire, wait_retired
from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

SPEC = ModelSpec("sever", num_layers=3, hidden=16, num_heads=2, ffn_hidden=32, vocab=256)
PLAN = Plan(replicas=(PipelinePlan(((0, 1), (2,)), (1, 2), 4),))
WORLD_PLAN = Plan(replicas=(PipelinePlan(((0,),), (3,), 1), PipelinePlan(((1,),), (3,), 3),
                            PipelinePlan(((2,),), (3,), 3)))
WORLD, DYING, SURVIVORS = 3, 1, (0, 2)
DIE_AT_ALL_REDUCE = 3
GLOO_TIMEOUT_S = 60  # what a blocked receive would wait if nothing woke it


def die_in_all_reduce(n: int) -> None:
    """Rank 1's n-th all-reduce kills its process (SIGKILL: no cleanup, the kernel closes its sockets)."""
    real = dist.all_reduce
    calls = 0

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]


def main() -> int:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    scenario = sys.argv[4] if len(sys.argv) > 4 else "pipeline"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=120))  # pyright: ignore[reportPrivateImportUsage]  # public (torch.distributed.TCPStore), not re-exported in its stub
    dist.init_process_group("gloo", store=PrefixStore("sever/", store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    rt = Runtime(SPEC, PLAN if scenario == "pipeline" else WORLD_PLAN, rank, TrainConfig(seed=1, max_seq_len=16))
    store.set(f"ready{rank}", "1")
    store.wait([f"ready{r}" for r in range(WORLD)])
    if rank == DYING and scenario == "pipeline":
        die_in_all_reduce(DIE_AT_ALL_REDUCE)
    result: dict[str, object] = {"rank": rank}
    start = time.monotonic()
    try:
        if scenario == "world" and rank != 0:
            raise RuntimeError(f"rank {rank} leaves the step before its DP all-reduce")
        rt.train_step(0)
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - the failure is what this test observes
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    result["failed_after_s"] = time.monotonic() - start
    retire(rt.let_go_of_groups())
    store.set(f"result{rank}", json.dumps(result))
    if rank == 0:
        reporters = SURVIVORS if scenario == "pipeline" else tuple(range(WORLD))
        store.wait([f"result{r}" for r in reporters])
        results = [json.loads(store.get(f"result{r}")) for r in reporters]
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"gloo_timeout_s": GLOO_TIMEOUT_S, "ranks": results}, fh)
    elif scenario == "world":
        store.wait(["result0"])  # alive until rank 0 is woken, as survivors are (their exit would wake it)
    wait_retired(30)  # the groups' destructors run on the retire thread: let them finish before exit
    os._exit(0)  # the default group has a dead member: skip torch's teardown at exit


if __name__ == "__main__":
    sys.exit(main())
