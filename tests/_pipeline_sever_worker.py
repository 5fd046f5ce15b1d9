"""One rank of the pipeline-sever test: a PP3 job whose first stage lets go of its groups
instead of sending, as a rank does when it sees a peer failure (``ResilientLoop._abort_groups``).

Usage: _pipeline_sever_worker.py RANK STORE_PORT OUT_JSON. Ranks 1 and 2 start a training
step and block in the pipeline's receive; each writes how long its step took to fail and the
error it saw, and then lets go of its own groups, so the failure travels down the pipeline.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from resihp.coordinator.plan import Plan
from resihp.coordinator.spec import ModelSpec
from resihp.trainer_hooks.groups import destroy_groups, retire, sever, wait_retired
from resihp.trainer_hooks.runtime import Runtime, TrainConfig

SPEC = ModelSpec("sever", num_layers=3, hidden=16, num_heads=2, ffn_hidden=32, vocab=256)
WORLD = 3
GLOO_TIMEOUT_S = 60  # what a blocked receive would wait if nothing woke it


def let_go(rt: Runtime) -> None:
    destroy_groups(rt.groups)
    retire(sever(rt.groups, rt.model))


def main() -> int:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("sever/", store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    rt = Runtime(SPEC, Plan.uniform(1, 3, 1, SPEC.num_layers, 2), rank, TrainConfig(seed=1, max_seq_len=16))
    store.set(f"ready{rank}", "1")
    store.wait([f"ready{r}" for r in range(WORLD)])
    result: dict[str, object] = {"rank": rank}
    if rank == 0:
        let_go(rt)  # never sends stage 0's activations
    else:
        start = time.monotonic()
        try:
            rt.train_step(0)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - the failure is what this test observes
            result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        result["failed_after_s"] = time.monotonic() - start
        let_go(rt)
    store.set(f"result{rank}", json.dumps(result))
    if rank == 0:
        store.wait([f"result{r}" for r in range(WORLD)])
        results = [json.loads(store.get(f"result{r}")) for r in range(WORLD)]
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"gloo_timeout_s": GLOO_TIMEOUT_S, "ranks": results}, fh)
    store.set(f"exit{rank}", "1")
    store.wait([f"exit{r}" for r in range(WORLD)])  # rank 0 hosts nothing, but keep the ranks' ends in step
    wait_retired(30)  # the groups' destructors run on the retire thread: let them finish before exit
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
