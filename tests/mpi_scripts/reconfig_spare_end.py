"""A plan readmitting an idle spare whose ``apply_at`` lies beyond the job's last step.

    RESIHP_STORE=host:port mpirun --with-ft ulfm ... -n 4 python reconfig_spare_end.py OUT

The job (TP2×DP2, resilient, scripted agent transport) excludes rank 3 at step EXCLUDE_AT;
rank 3 idles as a spare. The coordinator then sends a plan readmitting it with ``apply_at``
READMIT_AT > STEPS (a finding in the job's last steps does this): the spare receives it at
once, the members only at boundary MEMBERS_GET. The members never reach READMIT_AT; the job
must end when they finish, with the plan acknowledged as not applied on every rank (an
idle spare that entered the new epoch's rendezvous on receipt waited there for members that
had already left, until its join timeout).

Every rank writes OUT/RANK.json: committed steps, history, acknowledgements, its end step.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from reconfig_common import (
    GLOBAL_MB,
    SPEC,
    ScriptedAgent,
    report_and_exit,
    set_threads,
    start_resilient,
    train_records,
)

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.ulfm import ft_world

STEPS = 12
EXCLUDE_AT, MEMBERS_GET, READMIT_AT = 3, STEPS - 3, STEPS + 5
START = Plan.uniform(2, 1, 2, SPEC.num_layers, GLOBAL_MB)
EXCLUDED = Plan(replicas=(PipelinePlan(((0,), (1,)), (4, 4), 5), PipelinePlan(((2,),), (8,), 3)), spares=(3,))


class ScriptedTransport(ScriptedAgent):
    """The agent's side of the hooks: the exclusion reaches every rank at boundary 0; the
    readmission reaches a spare as soon as it idles, a member at boundary MEMBERS_GET."""

    def __init__(self) -> None:
        super().__init__()
        self.exclude = m.ReconfigCommand(epoch=10, plan=replace(EXCLUDED, epoch=10), apply_at=EXCLUDE_AT,
                                         reason="planned: exclude rank 3", seq=1)
        self.readmit = m.ReconfigCommand(epoch=11, plan=replace(START, epoch=11), apply_at=READMIT_AT,
                                         reason="planned: readmit rank 3", seq=2)
        self.sent: set[int] = set()

    def poll_commands(self) -> list[m.Command]:
        assert self.job is not None
        out: list[m.Command] = []
        if 1 not in self.sent:
            out.append(self.exclude)
        spare = self.job.runtime is None
        if 2 not in self.sent and (spare or self.job._iteration >= MEMBERS_GET):
            out.append(self.readmit)
        self.sent |= {c.seq for c in out}
        return out


def main() -> None:
    out = sys.argv[1]
    set_threads()
    world = ft_world()
    me, size = world.rank, world.size
    if size != 4:
        raise SystemExit(f"run with 4 ranks, got {size}")
    tx = ScriptedTransport()
    job, res = start_resilient(tx, START)
    records = train_records(job, res, STEPS)
    report = {"rank": me, "records": records, "history": res.history, "acks": tx.acks, "end": res.next_step,
              "epoch": res.rc.epoch, "failures": res.failures}
    report_and_exit(out, me, report)


if __name__ == "__main__":
    main()
