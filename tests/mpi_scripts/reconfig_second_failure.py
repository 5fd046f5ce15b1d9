"""Failures during reconfigurations: the resilient loop of ``resihp.trainer_hooks`` survives them.

    RESIHP_STORE=host:port mpirun --with-ft ulfm ... -n 8 python reconfig_second_failure.py OUT

Epoch 0: an uninterrupted TP2×PP2×DP2 reference run of STEPS steps (its losses). Then the same
job from the same seed runs through ``hooks.init`` (resilient; commands come from a scripted
agent transport, no coordinator, so recoveries use the documented survivor rule):

1. rank 5 SIGKILLs itself in the forward of step 3;
2. rank 2 SIGKILLs itself as the recovery from (1) starts moving state (new groups formed,
   transfers about to run) — a second failure during a reconfiguration;
3. a planned switch to PP2×DP3 arrives as a command applying at step 7; rank 6 SIGKILLs
   itself once every member has arrived at that switch, before any state moves — a failure
   during a planned reconfiguration. What the ranks agree on there travels with their
   arrivals (reconfig/world.py): a collective on the default group would leave its peers
   waiting out the gloo timeout ("Timed out waiting"), which the test looks for in the log.

Every survivor (0, 1, 3, 4, 7) writes OUT/RANK.json: its committed steps (loss, replica, sample
ids), the resilient loop's history and the acknowledgements; then leaves without MPI
finalisation (which can hang after a failure); the test ends mpirun.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from typing import Any

from reconfig_common import CONFIG, GLOBAL_MB, SPEC, reference_losses, report_and_exit, set_threads

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks import hooks
from resihp.trainer_hooks.launch.bootstrap import STORE_ENV
from resihp.trainer_hooks.reconfig import live as reconfigure_mod
from resihp.trainer_hooks.reconfig.ulfm import ft_world

STEPS = 12
KILL_IN_FORWARD = (3, 5)  # step, rank
KILL_IN_RECOVERY = 2  # dies as the first recovery's transfers start
KILL_IN_PLANNED = 6  # dies once every member has arrived at the planned switch
PLANNED_EPOCH = 100
PLANNED_AT = 7
# after (1) and (2) the survivors 0, 1, 3, 4, 6, 7 run the survivor rule's TP2×DP3; the planned
# switch makes them PP2×DP3
PLANNED = Plan(replicas=tuple(PipelinePlan(((a,), (b,)), (4, 4), mb)
                              for (a, b), mb in zip(((0, 1), (3, 4), (6, 7)), (3, 3, 2))))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class ScriptedTransport:
    """The agent's side of the hooks, scripted: the planned command arrives once the job has
    recovered from (1) and (2) and reached step 5 (before its apply_at, as a coordinator sends
    them); acknowledgements are kept."""

    def __init__(self) -> None:
        self.job: hooks.Job | None = None
        self.sent = False
        self.acks: list[tuple[int, int, int, bool, str]] = []

    def report(self, *args: object, **kwargs: object) -> bool:
        return True

    def probe(self, probe_s: float) -> None:  # compute probes are the agent's business
        return None

    def poll_commands(self) -> list[m.Command]:
        res = self.job.resilience if self.job is not None else None
        if self.sent or res is None or res.failures < 1 or res.next_step < 5:
            return []
        self.sent = True
        return [m.ReconfigCommand(epoch=PLANNED_EPOCH, plan=PLANNED, apply_at=PLANNED_AT, reason="planned: PP2xDP3",
                                  seq=1)]

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        self.acks.append((command.seq, command.epoch, iteration, ok, error))

    def close(self) -> None:
        pass


def arm_switch_kills(me: int) -> None:
    """The victim of (2) dies on entering the state transfer of its recovery; the victim of (3)
    as soon as every member has arrived at the planned switch."""
    real_reshard = reconfigure_mod.start_reshard
    real_arrivals = reconfigure_mod.await_arrivals

    def start_reshard(rplan: Any, rank: int, old: Any, new_plan: Plan, *args: Any, **kwargs: Any) -> Any:
        if me == KILL_IN_RECOVERY:
            die()
        return real_reshard(rplan, rank, old, new_plan, *args, **kwargs)

    def await_arrivals(store: Any, epoch: int, *args: Any, **kwargs: Any) -> list[str]:
        words = real_arrivals(store, epoch, *args, **kwargs)
        if me == KILL_IN_PLANNED and epoch == PLANNED_EPOCH:
            die()
        return words

    reconfigure_mod.start_reshard = start_reshard  # type: ignore[assignment]
    reconfigure_mod.await_arrivals = await_arrivals  # type: ignore[assignment]


def main() -> None:
    out = sys.argv[1]
    set_threads()
    store = os.environ[STORE_ENV]
    world = ft_world()
    me = world.rank
    start = Plan.uniform(2, 2, 2, SPEC.num_layers, GLOBAL_MB)

    ref_losses = reference_losses(world.comm, store, start, STEPS)  # the reference: uninterrupted

    tx = ScriptedTransport()
    job = hooks.init(SPEC, replace(start, epoch=1), config=CONFIG, transport=tx,
                     trace="", resilient=True, failure_timeout_s=5.0)
    tx.job = job
    res = job.resilience
    assert res is not None
    res.plan_wait_s = 0.0  # no coordinator here: the survivor rule decides at once
    arm_switch_kills(me)
    records: list[dict[str, Any]] = []
    for it in job.iterations(STEPS):
        if (it, me) == KILL_IN_FORWARD and job.runtime is not None:
            next(iter(job.runtime.model.layers.values())).register_forward_pre_hook(lambda *_: die())
        r = job.train_step(it)
        if r is None:  # a peer died; the job recovered and rolled back past the agreed step
            records = [x for x in records if x["step"] <= res.last_done]
        else:
            records.append({"step": it, "epoch": res.rc.epoch, "replica": r.replica, "loss": r.loss,
                            "samples": list(r.sample_ids)})
        job.step(r)
    report = {"rank": me, "records": records, "history": res.history, "acks": tx.acks, "ref_losses": ref_losses,
              "members": list(res.world.ranks), "plan": res.rc.plan.describe(), "final_step": res.last_done, "next_step": res.next_step,
              "role": "member" if res.rc.runtime is not None else "spare"}
    report_and_exit(out, me, report)


if __name__ == "__main__":
    main()
