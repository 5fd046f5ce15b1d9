"""A resilient job under plain mpirun: no node agent, so no coordinator; a rank dies.

    RESIHP_STORE=host:port RESIHP_FAULT=kill:1:3:optimizer mpirun --with-ft ulfm ... -n 4 python no_agent_kill.py OUT

TP2×DP2 on 4 ranks, STEPS steps, ``hooks.init`` with no transport and no agent address (a
NullTransport: nothing can send a recovery plan). The fault (trainer_hooks/faults.py) kills
rank 1 in its optimizer step at step 3, after every collective of that step: its peers
finish the step and meet the failure at the next one. The survivors recover with the
survivor rule and write OUT/RANK.json (the recovery's record and the job's end step).
"""
from __future__ import annotations

import sys
from dataclasses import replace

from reconfig_common import CONFIG, GLOBAL_MB, SPEC, report_and_exit, set_threads

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks import hooks

STEPS = 8


def main() -> None:
    out = sys.argv[1]
    set_threads()
    plan = replace(Plan.uniform(2, 1, 2, SPEC.num_layers, GLOBAL_MB), epoch=1)
    job = hooks.init(SPEC, plan, config=CONFIG, trace="", resilient=True, failure_timeout_s=5.0)
    res = job.resilience
    assert res is not None
    for it in job.iterations(STEPS):
        job.step(job.train_step(it))
    report_and_exit(out, job.rank, {"plan_wait_s": res.plan_wait_s, "history": res.history,
                                    "next_step": res.next_step, "members": list(res.rc.members)})


if __name__ == "__main__":
    main()
