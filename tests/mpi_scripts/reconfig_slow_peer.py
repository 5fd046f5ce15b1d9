"""A peer slow enough that the others wait longer than the failure timeout: a delay, not a death.

    RESIHP_STORE=host:port mpirun --with-ft ulfm ... -n 4 python reconfig_slow_peer.py OUT 3:FACTOR@AT

Epoch 0: an uninterrupted PP2×DP2 reference of STEPS steps (its losses). Then the same job
from the same seed runs resilient through ``hooks.init`` with a failure timeout of
TIMEOUT_S, and rank 3 throttled (RESIHP_THROTTLE) from step AT so far that its replica's
step takes several timeouts: the other replica waits for it in the DP all-reduce past the
timeout. Every peer lives: each such "failure" is a recovery that loses nobody, and the
groups' timeout doubles until the step fits (before: the step was redone with the same
timeout, for ever). The throttle (RANK:FACTOR@STEP[-UNTIL], as RESIHP_THROTTLE) is the second
argument; once it ends, short steps give the groups their original timeout back
(reconfig/timeouts.py). Every rank writes OUT/RANK.json: its committed steps, the failures it
went through, each change of the groups' timeout and the timeout at the end.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
from reconfig_common import (
    CONFIG,
    GLOBAL_MB,
    SPEC,
    ScriptedAgent,
    ft_script_start,
    reference_losses,
    report_and_exit,
    train_records,
)

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks import hooks
from resihp.trainer_hooks.env_settings import THROTTLE_ENV
from resihp.trainer_hooks.runtime.groups import communicators

STEPS = 20
TIMEOUT_S = 1.0
START = Plan.uniform(1, 2, 2, SPEC.num_layers, GLOBAL_MB)


class QuietAgent(ScriptedAgent):
    def poll_commands(self) -> list[m.Command]:
        return []


def main() -> None:
    out, store, world = ft_script_start(4)
    me = world.rank
    ref_losses = reference_losses(world.comm, store, START, STEPS)
    os.environ[THROTTLE_ENV] = sys.argv[2]  # for the resilient run only

    tx = QuietAgent()
    job = hooks.init(SPEC, replace(START, epoch=1), config=CONFIG, transport=tx, trace="", resilient=True,
                     failure_timeout_s=TIMEOUT_S)
    tx.job = job
    res = job.resilience
    assert res is not None
    records = train_records(job, res, STEPS)
    assert res.rc.runtime is not None
    # the timeout the groups in use hold now (gloo's own option, not resihp's bookkeeping)
    held = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in communicators(res.rc.runtime.groups)]
    report = {"rank": me, "records": records, "ref_losses": ref_losses, "failures": res.failures,
              "lost": [list(h.get("lost", [])) for h in res.history], "history": res.history,
              "group_timeout_s": res.rc.group_timeout_s, "timeouts": res.timeouts,
              "held_group_timeouts_s": sorted(set(held))}
    report_and_exit(out, me, report)


if __name__ == "__main__":
    main()
