"""A command that reaches the ranks at different boundaries: every rank still switches at one.

    RESIHP_STORE=host:port mpirun --with-ft ulfm ... -n 4 python reconfig_late_command.py OUT

Epoch 0: an uninterrupted TP2×DP2 reference of STEPS steps (its losses). Then the same job from
the same seed runs resilient through ``hooks.init`` with a scripted agent transport:

1. a switch to PP2×DP2 with ``apply_at`` LATE_AT reaches rank 0 at its first boundary, far
   ahead, and ranks 1-3 only at boundary LATE_ARRIVES, *after* its apply_at — the race a
   lagging coordinator can cause. Without an agreement rank 0 would switch before step
   LATE_AT while the others ran it, and each would wait on the other until gloo timed out;
2. a switch back to TP2×DP2 reaches every rank at boundary ON_TIME_ARRIVES, two boundaries
   before its ``apply_at`` ON_TIME_AT (the coordinator's margin): it applies exactly there.

Every rank writes OUT/RANK.json: its committed steps, the resilient loop's history and the
acknowledgements (command seq, iteration, ok).
"""
from __future__ import annotations

from dataclasses import replace

from reconfig_common import (
    GLOBAL_MB,
    SPEC,
    ScriptedAgent,
    ft_script_start,
    reference_losses,
    report_and_exit,
    start_resilient,
    train_records,
)

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m

STEPS = 14
LATE_AT, LATE_ARRIVES = 4, 6
ON_TIME_AT, ON_TIME_ARRIVES = 11, 9
START = Plan.uniform(2, 1, 2, SPEC.num_layers, GLOBAL_MB)
PP2DP2 = Plan.uniform(1, 2, 2, SPEC.num_layers, GLOBAL_MB)


class ScriptedTransport(ScriptedAgent):
    """The agent's side of the hooks: each command reaches this rank at a chosen boundary
    (the boundary after step N is the poll that follows step N)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        late_arrival = 0 if rank == 0 else LATE_ARRIVES
        self.script = [
            (late_arrival, m.ReconfigCommand(epoch=10, plan=replace(PP2DP2, epoch=10), apply_at=LATE_AT,
                                             reason="planned: PP2xDP2", seq=1)),
            (ON_TIME_ARRIVES, m.ReconfigCommand(epoch=11, plan=replace(START, epoch=11), apply_at=ON_TIME_AT,
                                                reason="planned: back to TP2xDP2", seq=2)),
        ]
        self.arrived: list[tuple[int, int]] = []  # (seq, boundary)

    def poll_commands(self) -> list[m.Command]:
        boundary = self.job._iteration if self.job is not None else -1
        due = [(at, c) for at, c in self.script if at <= boundary]
        self.script = [(at, c) for at, c in self.script if at > boundary]
        self.arrived += [(c.seq, boundary) for _, c in due]
        return [c for _, c in due]


def main() -> None:
    out, store, world = ft_script_start(4)
    me = world.rank

    ref_losses = reference_losses(world.comm, store, START, STEPS)  # the reference: uninterrupted

    tx = ScriptedTransport(me)
    job, res = start_resilient(tx, START)
    records = train_records(job, res, STEPS)
    report = {"rank": me, "records": records, "history": res.history, "acks": tx.acks, "arrived": tx.arrived,
              "ref_losses": ref_losses, "failures": res.failures}
    report_and_exit(out, me, report)


if __name__ == "__main__":
    main()
