"""One rank of the ULFM test, run under ``mpirun --with-ft ulfm``.

Usage: _ulfm_worker.py OUT_DIR SPEC_JSON, with $RESIHP_STORE_ADDR set. SPEC:
``{"steps": 8, "kills": [[step, "gloo"|"mpi", rank], ...], "recovery_victim": rank|-1}``.

Every step is a gloo all-reduce then an MPI all-reduce over the current members. A kill
``[s, "gloo", r]`` SIGKILLs rank r as step s's gloo all-reduce starts; ``"mpi"`` does so
after the gloo part, as the MPI all-reduce starts. ``recovery_victim`` dies in the first
recovery, right after Shrink. Survivors detect the failure, shrink, agree on the last
completed step, build a new gloo world, check an all-reduce in it, and resume after the
agreed step. At the end each survivor writes OUT_DIR/RANK.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

from resihp.trainer_hooks.reconfig.ulfm import bootstrap_gloo, ft_world, is_peer_failure, shrink


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    kills = {(s, mode): victim for s, mode, victim in spec["kills"]}
    recovery_victim = spec.get("recovery_victim", -1)
    world = ft_world()
    gloo = bootstrap_gloo(world, timeout_s=5.0)
    me = world.rank
    records: list[dict[str, Any]] = []
    step, last_step = 0, -1
    while step < spec["steps"]:
        try:
            expected = step * world.size + sum(world.ranks)
            if kills.get((step, "gloo")) == me:
                die()  # peers are entering the gloo all-reduce
            t = torch.tensor([float(step + me)])
            gloo.pg.allreduce([t]).wait()
            assert t.item() == expected, (t.item(), expected)
            if kills.get((step, "mpi")) == me:
                die()  # peers are entering the MPI all-reduce
            assert world.comm.allreduce(step + me) == expected
            last_step, step = step, step + 1
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not is_peer_failure(exc):
                raise
            detected = f"{type(exc).__name__}: {str(exc)[:160]}"

            def fault(phase: str) -> None:
                if phase == "shrunk" and me == recovery_victim and not records:
                    die()  # a second failure, in the middle of the recovery

            t0 = time.monotonic()
            world = shrink(world, last_step, fault=fault)
            shrink_s = time.monotonic() - t0
            gloo = bootstrap_gloo(world, timeout_s=5.0)
            t = torch.tensor([float(me + 1)])
            gloo.pg.allreduce([t]).wait()
            records.append({
                "survivors": list(world.ranks), "failed": list(world.failed), "attempts": world.attempts,
                "local_step": last_step, "agreed_step": world.agreed_step, "epoch": world.epoch,
                "prefix": gloo.prefix, "new_rank": gloo.rank, "sum": t.item(), "detected": detected,
                "shrink_s": round(shrink_s, 4),
            })
            step = last_step = world.agreed_step  # roll back to the last step everyone completed
            step += 1
    report = {"rank": me, "pid": os.getpid(), "final_step": last_step, "members": list(world.ranks), "records": records}
    tmp = os.path.join(out, f".{me}.tmp")
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(out, f"{me}.json"))
    os._exit(0)  # skip MPI finalisation, which can hang after a failure; the test ends mpirun


if __name__ == "__main__":
    main()
