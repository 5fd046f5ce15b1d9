"""An own loop in one plain process (an MPI world of one) with an in-memory agent.

    python tests/mpi_scripts/own_loop_single.py OUT_DIR MODE
MODE: "atexit" (never calls close: the exit hook must), "with" (``with init(...) as job``),
"raise" (the loop raises inside ``with``: no goodbye), "destroy" (the script makes its own
process group before init and destroys it before exit, as nanoGPT does). Writes OUT_DIR/summary.json from an
exit hook registered before ``init`` (so it runs after resihp's) and OUT_DIR/progress.jsonl.
"""
from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path
from typing import Any

import resihp.trainer_hooks as hooks
from resihp.trainer_hooks.reporting.reporter import MemoryTransport

SPEC = {"name": "own", "num_layers": 2, "hidden": 32, "num_heads": 4, "ffn_hidden": 64, "vocab": 256}


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    mem = MemoryTransport()
    state: dict[str, Any] = {}

    def summary() -> None:  # runs after resihp's exit hook
        state["closed"] = mem.closed
        state["reports"] = [{"iteration": r.iteration, "seqlens": [list(s) for s in r.seqlens],
                             "chunks": [[c.kind, c.microbatch, c.start_s, c.end_s] for c in r.chunks]}
                            for r in mem.reports]
        (out / "summary.json").write_text(json.dumps(state))

    atexit.register(summary)
    if mode == "destroy":
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        state["group"] = id(dist.group.WORLD)
    job = hooks.init(model=SPEC, transport=mem, progress=str(out / "progress.jsonl"), trace=str(out / "trace.jsonl"))
    state["microbatches_before"] = job.plan.global_microbatches
    with job if mode in ("with", "raise") else _Nothing():
        for it in range(3):
            for _mb in range(3):
                with job.timed("F"):
                    sum(range(2000))
                with job.timed("B"):
                    sum(range(4000))
            with job.timed("OPT"):
                pass
            if mode == "raise" and it == 1:
                raise RuntimeError("the loop failed")
            job.step(loss=2.0 - it / 10, tokens=1000 + it, seqlens=[[16]] * 2, microbatches=3)
        state["microbatches_after"] = job.plan.global_microbatches
        state["closed_in_loop"] = mem.closed
    state["closed_after_with"] = mem.closed
    if mode == "destroy":
        state["adopted"] = job.boot.adopted and state["group"] == id(dist.group.WORLD)
        dist.destroy_process_group()
    return 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
