"""Checkpoint-restart on a different layout, on real mpirun ranks (gloo).

    mpirun -n 8 python checkpoint_job.py save OUT      # TP2×PP2×DP2
    mpirun -n 4 python checkpoint_job.py resume OUT    # TP2×PP2×DP1, then PP4

save: STEPS steps of the reconfiguration tests' tiny job, checkpointing every EVERY steps
(keep 2) into OUT/ckpt until the "crash" after step CRASH_AFTER; the saved full state of the
last checkpoint goes to OUT/saved.npz. The job then goes on, uninterrupted and unsaved, to
STEPS: its losses are the reference. Rank 0 writes OUT/save.json.

resume: a new world of 4 ranks loads the latest checkpoint into TP2×PP2×DP1 (load_into),
checks the state against OUT/saved.npz bit for bit and trains the remaining steps; then
switches the running job to PP4 straight from the checkpoint (restore_live) and trains one
step. Rank 0 writes OUT/resume.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from reconfig_common import CONFIG, GLOBAL_MB, SPEC, compare, first_loss, gather_full, set_threads

from resihp.coordinator.model.plan import Plan
from resihp.trainer_hooks.checkpoint.format import writer_assignment
from resihp.trainer_hooks.checkpoint.saver import (
    AsyncCheckpointer,
    latest_checkpoint,
    list_checkpoints,
    load_full,
    load_into,
    restore_live,
)
from resihp.trainer_hooks.launch.bootstrap import Bootstrap
from resihp.trainer_hooks.reconfig.live import LiveReconfigurer
from resihp.trainer_hooks.runtime.groups import destroy_groups
from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs

L = SPEC.num_layers
STEPS, EVERY, CRASH_AFTER = 7, 2, 4  # saves after steps 1 and 3; the crash loses step 4


def flat(full: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{s}/{n}": a for s, by in full.items() for n, a in by.items()}


def unflat(npz: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in npz.items():
        s, n = key.split("/", 1)
        out.setdefault(s, {})[n] = arr
    return out


def save_phase(boot: Bootstrap, out: Path) -> dict:
    comm = boot.comm
    plan = Plan.uniform(2, 2, 2, L, GLOBAL_MB)
    boot.init_epoch(0)
    rc = LiveReconfigurer(SPEC, plan, boot.rank, CONFIG, boot.info().store_addr, timeout_s=120)
    cp = AsyncCheckpointer(out / "ckpt", boot.rank, SPEC, CONFIG, keep=2, run_id=f"{boot.job_start_s:.6f}")
    losses, step_s, saved = [], [], None
    for step in range(STEPS):
        t0 = time.perf_counter()
        r = rc.train_step(step)
        step_s.append(time.perf_counter() - t0)
        if step <= CRASH_AFTER:
            rec = cp.maybe_save(step, rc.runtime, plan, every=EVERY)
            if rec is not None:
                saved = gather_full(comm, rc)  # the state this save snapshotted
        if step == CRASH_AFTER:
            cp.close(120)  # the last save is committed; after this the run counts as crashed
        losses.append(first_loss(comm, r.loss if r else None))
    recs = comm.gather([(x.snapshot_s, x.write_s, x.nbytes) for x in cp.records], root=0)
    assert rc.runtime is not None
    destroy_groups(rc.runtime.groups)
    if boot.rank != 0:
        return {}
    assert saved is not None
    saved.pop("_step")
    # allow_pickle: numpy's default, named so that every keyword left is an array
    np.savez(out / "saved.npz", allow_pickle=True, **flat(saved))
    last = latest_checkpoint(out / "ckpt")
    assert last is not None
    numel = sum(t.numel for t in gpt_tensor_specs(SPEC, CONFIG.max_seq_len))
    snaps = [s for per in recs for s, _, n in per if n]
    return {
        "losses": losses, "checkpoints": [s for s, _ in list_checkpoints(out / "ckpt")],
        "bytes_on_disk": sum(f.stat().st_size for f in last.glob("*.bin")), "state_bytes": 3 * 4 * numel,
        "writers": sorted(writer_assignment(plan, gpt_tensor_specs(SPEC, CONFIG.max_seq_len))),
        "snapshot_s_max": max(snaps), "snapshot_s_mean": sum(snaps) / len(snaps),
        "write_s_max": max(w for per in recs for _, w, _ in per), "step_s_median": sorted(step_s)[len(step_s) // 2],
    }


def resume_phase(boot: Bootstrap, out: Path) -> dict:
    comm = boot.comm
    saved = unflat(dict(np.load(out / "saved.npz"))) if boot.rank == 0 else None
    path = latest_checkpoint(out / "ckpt")
    assert path is not None
    plan = Plan.uniform(2, 2, 1, L, GLOBAL_MB)
    boot.init_epoch(0)
    rc = LiveReconfigurer(SPEC, plan, boot.rank, CONFIG, boot.info().store_addr, timeout_s=120)
    resume = load_into(rc.runtime, plan, boot.rank, path)
    got = gather_full(comm, rc)
    report: dict = {"loaded_from": str(path), "resume_at": resume}
    if boot.rank == 0:
        assert got is not None and saved is not None
        report["adam_step"] = float(got.pop("_step")["step"][0])
        report["load_into_vs_saved"] = compare(got, saved)
        meta, full = load_full(path)
        report["load_full_vs_saved"] = compare(full, saved)
    losses = {}
    for step in range(resume, STEPS):
        r = rc.train_step(step)
        losses[str(step)] = first_loss(comm, r.loss if r else None)
    report["losses"] = losses
    # the fail-stop path with no live replica: switch the running job to PP4 from the checkpoint
    pp4 = Plan.uniform(1, 4, 1, L, GLOBAL_MB)
    live, at = restore_live(rc, pp4, 1, path)
    got = gather_full(comm, rc)
    r = rc.train_step(at)
    loss = first_loss(comm, r.loss if r else None)
    moved = comm.gather(live.bytes_moved, root=0)
    if boot.rank == 0:
        assert got is not None and saved is not None
        got.pop("_step")
        report["restore_live"] = {"state_vs_saved": compare(got, saved), "bytes_moved": sum(moved), "loss": loss,
                                  "resume_at": at}
    assert rc.runtime is not None
    destroy_groups(rc.runtime.groups)
    return report


def main() -> int:
    phase, out = sys.argv[1], Path(sys.argv[2])
    set_threads()
    boot = Bootstrap(timeout_s=120)
    want = {"save": 8, "resume": 4}[phase]
    if boot.world_size != want:
        raise SystemExit(f"the {phase} phase runs on {want} ranks, got {boot.world_size}")
    report = save_phase(boot, out) if phase == "save" else resume_phase(boot, out)
    if boot.rank == 0:
        (out / f"{phase}.json").write_text(json.dumps(report, indent=1))
        print(f"{time.strftime('%H:%M:%S')} {phase}: {json.dumps({k: v for k, v in report.items() if k != 'losses'})}",
              flush=True)
    boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
