"""Fail-stop recovery: ranks SIGKILL themselves mid-step; the survivors carry on.

    RESIHP_STORE_ADDR=host:port mpirun --with-ft ulfm ... -n 8 python reconfig_failstop.py OUT SPEC_JSON

SPEC: {"steps": N, "kills": [[step, phase, rank], ...]} with phase one of forward,
backward, gradsync (as the DP gradient all-reduce starts), optimizer (inside AdamW's step,
after every collective of the step). The store lives in its own process (the test's).

Epoch 0: an uninterrupted TP2×PP2×DP2 reference run up to the first kill's step (its losses
and full state there; with "full_reference": true in SPEC, all N steps). Epoch 1 on: the same job from the same seed, with the kills;
survivors detect, shrink, roll back, replan (reconfig.failstop.survivor_plan), reshard, resume.
Every survivor writes OUT/RANK.json (its committed steps: loss, replica, sample ids), then
leaves without MPI finalisation (which can hang after a failure); the test ends mpirun.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist
from mpi4py import MPI
from reconfig_common import CONFIG, GLOBAL_MB, SPEC, compare, gather_full, report_and_exit, set_threads

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.reconfig.failstop import StepGuard, recover
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.reconfig.ulfm import STORE_ENV, ft_world, is_peer_failure
from resihp.trainer_hooks.reconfig.world import init_world
from resihp.trainer_hooks.runtime.groups import destroy_groups

GLOO_TIMEOUT_S = 5.0
END_TAG = 4242


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(rc: LiveReconfigurer, phase: str) -> None:
    """Make this rank SIGKILL itself in ``phase`` of the coming step."""
    rt = rc.runtime
    assert rt is not None, "a kill victim must be a member"
    if phase == "forward":
        calls = [0]

        def pre(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:  # the second micro-batch's forward: the pipeline is busy
                die()

        next(iter(rt.model.layers.values())).register_forward_pre_hook(pre)
    elif phase == "backward":
        next(iter(rt.model.parameters())).register_hook(lambda grad: die())
    elif phase == "gradsync":
        real = dist.all_reduce

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            # the gradient sums' one all-reduce call (trainer.sum_in_place)
            if sys._getframe(1).f_code.co_name == "sum_in_place":
                die()
            return real(*args, **kwargs)

        dist.all_reduce = all_reduce  # type: ignore[assignment]
    elif phase == "optimizer":
        rt.optimizer.register_step_pre_hook(lambda *_: die())
    else:
        raise SystemExit(f"unknown kill phase {phase!r}")


def main() -> None:
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    steps = int(spec["steps"])
    kills = {int(s): (phase, int(r)) for s, phase, r in spec["kills"]}
    set_threads()
    store = os.environ[STORE_ENV]
    world = ft_world()
    me = world.rank
    start = Plan.uniform(2, 2, world.size // 4, SPEC.num_layers, GLOBAL_MB)
    first_kill = min(kills) if kills else steps

    # reference: uninterrupted
    init_world(store, 0, me, world.size, 120.0)
    ref = LiveReconfigurer(SPEC, start, me, CONFIG, store, timeout_s=120.0)
    ref_losses: list[float | None] = []
    ref_state = None
    ref_steps = steps if spec.get("full_reference") else first_kill
    for step in range(ref_steps + 1):
        if step == first_kill:
            ref_state = gather_full(world.comm, ref)
        if step == ref_steps:
            break
        r = ref.train_step(step)
        ref_losses.append(r.loss if r else None)
    all_ref = world.comm.allgather(ref_losses)
    ref_losses = [next((v[i] for v in all_ref if v[i] is not None), None) for i in range(ref_steps)]
    assert ref.runtime is not None
    destroy_groups(ref.runtime.groups)

    print(f"{time.strftime('%H:%M:%S')} rank {me}: reference done", file=sys.stderr, flush=True)
    # the job with failures
    init_world(store, 1, me, world.size, GLOO_TIMEOUT_S)
    rc = LiveReconfigurer(SPEC, start, me, CONFIG, store, timeout_s=GLOO_TIMEOUT_S, group_timeout_s=GLOO_TIMEOUT_S,
                          epoch=1)
    guard = StepGuard()
    records: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    step, last = 0, -1
    while step < steps:
        try:
            if rc.runtime is None:
                # a spare: idle until the run ends or a failure revokes the communicator
                step = last = int(world.comm.recv(source=MPI.ANY_SOURCE, tag=END_TAG))
                break
            guard.before_step(rc, step)
            if kills.get(step, ("", -1))[1] == me:
                arm(rc, kills[step][0])
            r = rc.train_step(step)
            assert r is not None
            records.append({"step": step, "epoch": rc.epoch, "replica": r.replica, "loss": r.loss,
                            "samples": list(r.sample_ids)})
            last, step = step, step + 1
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not is_peer_failure(exc) and not is_peer_failure(exc.__cause__ or exc):
                raise
            t0 = time.perf_counter()
            detected = f"{type(exc).__name__}: {str(exc)[:200]}"
            rec = recover(rc, world, last, guard, detected_at=t0, cause=exc)
            world = rec.world
            records = [x for x in records if x["step"] < rec.resume_at]
            info: dict[str, Any] = {
                "at_step": step, "local_last": last, "agreed": world.agreed_step, "failed": list(world.failed),
                "survivors": list(world.ranks), "epoch": rc.epoch, "plan": rec.plan.to_dict(),
                "role": rec.report.role, "bytes_moved": rec.report.bytes_moved, "detected": detected,
                "shrink_s": rec.shrink_s, "recovery_s": rec.detect_to_ready_s,
            }
            if not recoveries:  # the first recovery: state equals the reference's before that step, bit for bit
                got = gather_full(world.comm, rc)  # on logical rank 0, which the tests never kill
                if got is not None and ref_state is not None:
                    info["vs_ref"] = compare(got, ref_state)
            recoveries.append(info)
            print(f"{time.strftime('%H:%M:%S')} rank {me}: lost {list(world.failed)}, resuming at {world.agreed_step + 1} "
                  f"as {rec.report.role} in {rec.detect_to_ready_s:.2f} s", file=sys.stderr, flush=True)
            step = last = world.agreed_step
            step += 1
    if rc.runtime is not None and world.comm.Get_rank() == min(
            i for i, r in enumerate(world.ranks) if rc.plan.has_rank(r)):
        for i, r in enumerate(world.ranks):
            if not rc.plan.has_rank(r):
                world.comm.send(last, dest=i, tag=END_TAG)
    report = {"rank": me, "final_step": last, "members": list(world.ranks), "records": records,
              "recoveries": recoveries, "ref_losses": ref_losses}
    report_and_exit(out, me, report)


if __name__ == "__main__":
    main()
