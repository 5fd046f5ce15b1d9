"""Planned live reconfigurations on 4 ranks, against an uninterrupted reference run.

    mpirun -n 4 python tests/mpi_scripts/reconfig_planned.py --out DIR

Epoch 0: the reference, TP2×DP2 for STEPS steps, its full state gathered at every switch
step. Then the same job from the same seed runs again and switches plan at the start of
each step in SWITCHES (TP 2→4, TP 4→2 with PP2, PP (4,4)→(5,3), TP2×PP2 → PP2×DP2, DP
shares (4,4)→(6,2), excluding rank 3 as a spare, readmitting it, a TP2 replica beside a
TP1 one). The switches arrive as
ReconfigCommands through the hooks (``Job.step`` with a scripted agent transport) and are
applied by ``LiveReconfigurer.on_reconfigure`` at their ``apply_at``; every rank acknowledges.
Around every switch the full state is gathered before and after. Rank 0 writes DIR/planned.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from reconfig_common import CONFIG, GLOBAL_MB, SPEC, compare, first_loss, four_rank_start, gather_full, step_samples

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.hooks import Job
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.runtime.groups import destroy_groups

L = SPEC.num_layers
STEPS = 62  # the issue asks for loss curves over >= 50 steps through the switches


def pp(stages: tuple[tuple[int, ...], ...], layers: tuple[int, ...], mbs: int) -> PipelinePlan:
    return PipelinePlan(stages, layers, mbs)


START = Plan.uniform(2, 1, 2, L, GLOBAL_MB)  # TP2×DP2
# (step the new plan applies at, name, plan)
SWITCHES: list[tuple[int, str, Plan]] = [
    (4, "tp2dp2_to_tp4", Plan.uniform(4, 1, 1, L, GLOBAL_MB)),
    (10, "tp4_to_tp2pp2", Plan.uniform(2, 2, 1, L, GLOBAL_MB)),
    (16, "pp_44_to_53", Plan(replicas=(pp(((0, 1), (2, 3)), (5, 3), GLOBAL_MB),))),
    (22, "tp2pp2_to_pp2dp2", Plan.uniform(1, 2, 2, L, GLOBAL_MB)),
    (28, "dp_shares_44_to_62", Plan(replicas=(pp(((0,), (1,)), (4, 4), 6), pp(((2,), (3,)), (4, 4), 2)))),
    (34, "exclude_rank3", Plan(replicas=(pp(((0,), (1,)), (4, 4), 5), pp(((2,),), (8,), 3)), spares=(3,))),
    (40, "readmit_rank3", Plan(replicas=(pp(((0,), (1,)), (5, 3), 4), pp(((2,), (3,)), (5, 3), 4)))),
    # replicas that split the same layers over different TP sizes (runtime/groups.mixed_tp_names)
    (46, "pp2dp2_to_mixed_tp", Plan(replicas=(pp(((0, 1),), (8,), 4), pp(((2,), (3,)), (5, 3), 4)))),
]


class ScriptedTransport:
    """The agent's side of the hooks, scripted: every command arrives at the first poll
    (well before its apply_at, as the coordinator sends them); acks are kept."""

    def __init__(self, commands: list[m.ReconfigCommand]) -> None:
        self._commands = list(commands)
        self.acks: list[tuple[m.Command, int, bool]] = []

    def report(self, *args: object, **kwargs: object) -> bool:
        return True

    def probe(self, probe_s: float) -> None:  # compute probes are the agent's business
        return None

    def poll_commands(self) -> list[m.Command]:
        out, self._commands = self._commands, []
        return list(out)

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        if not ok:
            raise AssertionError(f"command {command.seq} failed: {error}")
        self.acks.append((command, iteration, ok))

    def close(self) -> None:
        pass


def main() -> int:
    args, boot = four_rank_start(STEPS)
    comm = boot.comm
    at = {s: (name, plan) for s, name, plan in SWITCHES if s < args.steps}
    store = boot.info().store_addr

    # the reference: no switch
    boot.init_epoch(0)
    ref = LiveReconfigurer(SPEC, START, boot.rank, CONFIG, store, timeout_s=120)
    ref_losses, ref_states = [], {}
    for step in range(args.steps):
        if step in at:
            ref_states[step] = gather_full(comm, ref)
        r = ref.train_step(step)
        ref_losses.append(first_loss(comm, r.loss if r else None))
    assert ref.runtime is not None
    destroy_groups(ref.runtime.groups)

    # the same job, switching live: the switches arrive as ReconfigCommands through the hooks
    boot.init_epoch(1)
    rc = LiveReconfigurer(SPEC, START, boot.rank, CONFIG, store, timeout_s=120, epoch=1)
    commands = [m.ReconfigCommand(epoch=2 + i, plan=plan, apply_at=s, reason=name, seq=i + 1)
                for i, (s, (name, plan)) in enumerate(sorted(at.items()))]
    transport = ScriptedTransport(commands)
    job = Job(boot=boot, model=SPEC, plan=START, config=CONFIG, transport=transport, throttle=rc.throttle,
              runtime=rc.runtime)
    apply = rc.on_reconfigure()
    switches: list[dict] = []

    def on_reconfigure(job: Job, cmd: m.ReconfigCommand) -> None:
        step = cmd.apply_at
        before = gather_full(comm, rc)
        apply(job, cmd)
        report = rc.history[-1]
        after = gather_full(comm, rc)
        downtimes = comm.gather(report.downtime_s, root=0)
        roles = comm.gather(report.role, root=0)
        # groups kept from the old plan, and how many this rank holds now (the default group aside)
        held = [g for g in rc.runtime.groups._by_ranks.values() if g is not None and g is not dist.group.WORLD] \
            if rc.runtime is not None else []
        kept = comm.gather((report.world_kept, report.groups_kept, len(held)), root=0)
        if boot.rank == 0:
            assert before is not None and after is not None
            moved = compare(after, before)
            vs_ref = compare(after, ref_states[step])
            switches.append({
                "step": step, "name": cmd.reason, "epoch": cmd.epoch, "moved_bitwise": moved["bitwise"],
                "vs_ref_bitwise": vs_ref["bitwise"], "vs_ref_max_abs": vs_ref["max_abs"],
                "vs_ref_max_rel": vs_ref["max_rel"], "bytes_moved": report.bytes_moved,
                "downtime_s": max(downtimes), "roles": roles, "job_epoch": job.epoch, "kept": kept,
            })

    job.on_reconfigure = on_reconfigure
    losses, samples_ok = [], True
    for step in range(args.steps):
        r = rc.train_step(step)
        losses.append(first_loss(comm, r.loss if r else None))
        ids = step_samples(comm, rc, r.sample_ids if r else None)
        if boot.rank == 0 and ids != list(range(step * GLOBAL_MB, (step + 1) * GLOBAL_MB)):
            samples_ok = False
        job.step(r) if r is not None else job.step(iteration=step)  # applies what is due at step + 1
    acks = comm.gather([(a.seq, it, ok) for a, it, ok in transport.acks], root=0)
    if boot.rank == 0:
        Path(args.out, "planned.json").write_text(json.dumps({
            "ref_losses": ref_losses, "losses": losses, "switches": switches, "samples_ok": samples_ok,
            "acks": acks, "commands": [(c.seq, c.apply_at) for c in commands],
        }, indent=1))
    if rc.runtime is not None:
        destroy_groups(rc.runtime.groups)
    boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
