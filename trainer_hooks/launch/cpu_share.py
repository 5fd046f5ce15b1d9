"""One rank, one "device": a fixed share of the CPU for each rank of a job on a shared machine.

    python -m resihp.trainer_hooks.launch.cpu_share --cores 0.25 --group resihp-JOB -- CMD ...

puts this process in the CPU cgroup ``<cpu root>/<group>/rank-<R>`` (R: Open MPI's world
rank) with a CFS quota of ``cores`` CPUs and execs CMD in the same process.
``resihp launch --cpu-per-rank X`` starts every rank this way.

Why: eight ranks on two cores are not eight devices. A rank that sleeps (a throttled "slow
device", a pipeline bubble, a spare) hands its CPU to the others, so on this machine a 2×
slow rank cost a static job 0–10 % where a 2×-slow GPU costs a synchronous job up to half,
and a job that idles two ranks runs faster than the healthy eight did (bench/e2e.py). With a
quota each rank gets at most its share however idle the others are: a fixed-speed device, as
a GPU is. Nothing here is needed on real devices.

cgroup v1 (``cpu.cfs_quota_us``) and v2 (``cpu.max``) are both handled; without a writable
CPU controller (not root, no cgroup mount) the command fails with what is missing, before
the rank starts.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

PERIOD_US = 20_000  # a short period: a rank throttled for its quota waits at most this long


class CpuShareError(RuntimeError):
    pass


def cpu_root() -> tuple[Path, int]:
    """(the writable CPU controller's root, cgroup version)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, 1
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split() \
            and os.access(v2, os.W_OK):
        return v2, 2
    raise CpuShareError("no writable CPU cgroup controller (cgroup v1 /sys/fs/cgroup/cpu or v2 with the cpu "
                        "controller; run as root): --cpu-per-rank needs one")


def confine(group: str, name: str, cores: float, pid: int | None = None) -> Path:
    """Put ``pid`` (default: this process) in ``<root>/<group>/<name>`` limited to ``cores`` CPUs."""
    if not (math.isfinite(cores) and cores > 0):
        raise CpuShareError(f"cores must be a number of CPUs > 0, got {cores!r}")
    if not group or "/" in group or not name or "/" in name:
        raise CpuShareError(f"cgroup names must be plain names, got {group!r} / {name!r}")
    root, version = cpu_root()
    where = root / group / name
    try:
        where.mkdir(parents=True, exist_ok=True)
        quota = max(1000, int(cores * PERIOD_US))
        if version == 1:
            (where / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (where / "cpu.cfs_quota_us").write_text(str(quota))
            (where / "cgroup.procs").write_text(str(pid or os.getpid()))
        else:
            parent = root / group
            (parent / "cgroup.subtree_control").write_text("+cpu")
            (where / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (where / "cgroup.procs").write_text(str(pid or os.getpid()))
    except OSError as exc:
        raise CpuShareError(f"could not confine to {cores} CPUs in {where}: {exc}") from None
    return where


def release(group: str) -> int:
    """Remove the job's cgroups once its processes have left them; how many were removed."""
    try:
        root, _ = cpu_root()
    except CpuShareError:
        return 0
    top = root / group
    removed = 0
    for leaf in sorted(top.glob("*/"), reverse=True) if top.is_dir() else ():
        try:
            leaf.rmdir()
            removed += 1
        except OSError:
            pass  # a process is still in it (or it is gone already)
    try:
        top.rmdir()
    except OSError:
        pass
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    p = argparse.ArgumentParser(prog="python -m resihp.trainer_hooks.launch.cpu_share")
    p.add_argument("--cores", type=float, required=True)
    p.add_argument("--group", required=True)
    opts = p.parse_args(args[:split])
    cmd = args[split + 1:]
    if not cmd:
        p.error("give the command after '--'")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK") or str(os.getpid())
    try:
        confine(opts.group, f"rank-{rank}", opts.cores)
    except CpuShareError as exc:
        print(f"resihp cpu_share: {exc}", file=sys.stderr)
        return 2
    from resihp.trainer_hooks.launch.rank_env import exec_command

    return exec_command(cmd, "cpu_share")


if __name__ == "__main__":
    sys.exit(main())
