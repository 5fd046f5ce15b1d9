"""The same steps under different token shares, on 4 real ranks (PP2 x DP2, gloo).

    mpirun -n 4 python tests/mpi_scripts/docshares.py --out DIR

Runs, each from the same seed and data, in its own plan epoch: ``even`` (whole micro-batches,
4 and 4: the old data path), ``60/40`` and ``75/25`` (token shares of the global batch, cut
by the document, in 5 + 4 and 6 + 2 micro-batches), ``50/50 in 6+6`` (more micro-batches
than the batch has: a step with fewer documents pads the count with micro-batches that train
nothing), and ``switching``: even, then a live
re-plan into 75/25 tokens at SWITCH_IN and back out to whole micro-batches at SWITCH_OUT,
the commands arriving through the hooks (``Job.step`` with a scripted agent transport) and
applied by ``LiveReconfigurer.on_reconfigure``. Rank 0 writes DIR/docshares.json: every
run's losses, its final full state, and per switch what it moved.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from reconfig_common import CONFIG, GLOBAL_MB, SPEC, compare, first_loss, four_rank_start, gather_full
from reconfig_planned import ScriptedTransport

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.hooks import Job
from resihp.trainer_hooks.launch.bootstrap import Bootstrap
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.runtime.groups import destroy_groups

L = SPEC.num_layers
TOKENS = GLOBAL_MB * CONFIG.budget  # the global batch in tokens
STEPS = 20
SWITCH_IN, SWITCH_OUT = 7, 14


def shares(first: tuple[int, int], second: tuple[int, int]) -> Plan:
    """PP2 x DP2: replica 0 on ranks 0, 1 and replica 1 on ranks 2, 3; (micro-batches, tokens) each."""
    return Plan(replicas=(PipelinePlan(((0,), (1,)), (L // 2, L // 2), *first),
                          PipelinePlan(((2,), (3,)), (L // 2, L // 2), *second)))


EVEN = Plan.uniform(1, 2, 2, L, GLOBAL_MB)
SIXTY = round(0.6 * TOKENS)
QUARTER = TOKENS // 4
RUNS: dict[str, Plan] = {
    "even": EVEN,
    "60/40": shares((5, SIXTY), (4, TOKENS - SIXTY)),
    "75/25": shares((6, TOKENS - QUARTER), (2, QUARTER)),
    "50/50 in 6+6": shares((6, TOKENS // 2), (6, TOKENS - TOKENS // 2)),
}


def run_fixed(comm: Any, boot: Bootstrap, epoch: int, plan: Plan, steps: int) -> dict[str, Any]:
    boot.init_epoch(epoch)
    rc = LiveReconfigurer(SPEC, plan, boot.rank, CONFIG, boot.info().store_addr, timeout_s=120, epoch=epoch)
    losses, padding = [], 0
    for step in range(steps):
        r = rc.train_step(step)
        losses.append(first_loss(comm, r.loss if r else None))
        # padding micro-batches are one token each that trains nothing; counted on stage 0 of each replica
        mine = sum(map(sum, r.seqlens)) - r.tokens if r is not None and boot.rank in (0, 2) else 0
        padding += sum(comm.gather(mine, root=0) or [])
    state = gather_full(comm, rc)
    assert rc.runtime is not None
    destroy_groups(rc.runtime.groups)
    return {"losses": losses, "state": state, "padding": padding}


def run_switching(comm: Any, boot: Bootstrap, epoch: int, steps: int) -> dict[str, Any]:
    """Even, then into 75/25 tokens and out again, live through the hooks."""
    boot.init_epoch(epoch)
    rc = LiveReconfigurer(SPEC, EVEN, boot.rank, CONFIG, boot.info().store_addr, timeout_s=120, epoch=epoch)
    commands = [m.ReconfigCommand(epoch=epoch + 1, plan=RUNS["75/25"], apply_at=SWITCH_IN, reason="into", seq=1),
                m.ReconfigCommand(epoch=epoch + 2, plan=EVEN, apply_at=SWITCH_OUT, reason="out", seq=2)]
    transport = ScriptedTransport(commands)
    job = Job(boot=boot, model=SPEC, plan=EVEN, config=CONFIG, transport=transport, throttle=rc.throttle,
              runtime=rc.runtime)
    apply = rc.on_reconfigure()
    switches: list[dict[str, Any]] = []

    def on_reconfigure(job: Job, cmd: m.ReconfigCommand) -> None:
        before = gather_full(comm, rc)
        apply(job, cmd)
        after = gather_full(comm, rc)
        report = rc.history[-1]
        assert rc.runtime is not None and rc.runtime.plan.replicas == cmd.plan.replicas  # its data view too
        if boot.rank == 0:
            assert before is not None and after is not None
            switches.append({"name": cmd.reason, "step": cmd.apply_at, "bytes_moved": report.bytes_moved,
                             "unchanged": compare(after, before)["bitwise"],
                             "document_shares": cmd.plan.document_shares})

    job.on_reconfigure = on_reconfigure
    losses, micro = [], []
    for step in range(steps):
        r = rc.train_step(step)
        losses.append(first_loss(comm, r.loss if r else None))
        counts = comm.gather(len(r.seqlens) if r is not None else -1, root=0)
        micro.append(counts)
        job.step(r) if r is not None else job.step(iteration=step)  # applies what is due at step + 1
    state = gather_full(comm, rc)
    acks = comm.gather([(a.seq, it, ok) for a, it, ok in transport.acks], root=0)
    assert rc.runtime is not None
    destroy_groups(rc.runtime.groups)
    return {"losses": losses, "state": state, "switches": switches, "acks": acks, "microbatches": micro}


def main() -> int:
    args, boot = four_rank_start(STEPS)
    comm = boot.comm
    results = {name: run_fixed(comm, boot, 10 * i, plan, args.steps) for i, (name, plan) in enumerate(RUNS.items())}
    results["switching"] = run_switching(comm, boot, 10 * len(RUNS), args.steps)
    if boot.rank == 0:
        ref = results["even"]["state"]
        out = {name: {"losses": res["losses"], "vs_even": compare(res["state"], ref),
                      **{k: v for k, v in res.items() if k not in ("losses", "state")}}
               for name, res in results.items()}
        Path(args.out, "docshares.json").write_text(json.dumps(out, indent=1))
    boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
