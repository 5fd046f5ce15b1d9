"""``resihp launch --layout auto``: a profile-only start of the training script on the job's
ranks, before the coordinator, agents and store exist.

The ranks run the script as usual up to ``hooks.init``, which times the healthy layouts
(trainer_hooks/runtime/autolayout.py); rank 0 prints the choice as one line of stdout and
every rank leaves. The launcher reads that line (mpirun forwards every node's stdout, so no
shared file system is needed), keeps it as ``<run-dir>/layout.json``, and starts the job at
that layout: the coordinator with its TP/PP/DP, the ranks with ``$RESIHP_LAYOUT_PLAN``.
"""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.autolayout import (
    LAYOUT_ENV,
    LAYOUT_PLAN_ENV,
    LAYOUT_PROFILE_ENV,
    MICROBATCHES_ENV,
    read_choice,
    write_choice,
)

# what the job's daemons hand the ranks: a profile-only start has no daemons to reach
DAEMON_ENV = ("RESIHP_TOKEN", "RESIHP_COORDINATOR", "RESIHP_AGENT_ADDR", "RESIHP_AGENT_ADDRS", "RESIHP_STORE",
              "RESIHP_STORE_ADDR", "RESIHP_RANK_TOKEN", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
              LAYOUT_PLAN_ENV)


def profile_env(base: Mapping[str, str], n: int, ranks_per_node: int, microbatches: int,
                extra: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The profile start's environment, and the names mpirun must forward (``-x``)."""
    env = {k: v for k, v in base.items() if k not in DAEMON_ENV}
    env.update(extra)
    env.update({LAYOUT_PROFILE_ENV: "1", LAYOUT_ENV: "auto", "RESIHP_WORLD_SIZE": str(n)})
    names = [LAYOUT_PROFILE_ENV, LAYOUT_ENV, "RESIHP_WORLD_SIZE", *extra]
    if ranks_per_node:
        env["RESIHP_RANKS_PER_NODE"] = str(ranks_per_node)
        names.append("RESIHP_RANKS_PER_NODE")
    if microbatches:
        env[MICROBATCHES_ENV] = str(microbatches)
        names.append(MICROBATCHES_ENV)
    return env, names


def run_profile(line_for: Callable[[Sequence[str]], list[str]], env: Mapping[str, str], names: Sequence[str],
                run: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the profile start (``line_for(names)`` is its mpirun line), keep its output in
    ``<run>/layout-profile.log`` and its choice in ``<run>/layout.json``; the choice."""
    line = line_for(names)
    log = run / "layout-profile.log"
    try:
        done = subprocess.run(line, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s, start_new_session=True, check=False)
        out = done.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
        log.write_text(out)
        raise SpecError(f"--layout auto: the layout profile did not finish in {timeout_s:.0f} s (its output: {log})"
                        ) from None
    log.write_text(out)
    record = read_choice(out)
    if record is None:
        tail = "\n".join(out.splitlines()[-15:])
        raise SpecError(f"--layout auto: the layout profile (exit status {done.returncode}) printed no choice: the "
                        f"training script must call hooks.init with AutoLayout or no plan (examples/train_gpt.py "
                        f"does under --layout auto). Its output is in {log}; the last lines:\n{tail}")
    write_choice(record, run / "layout.json")
    return record


def scratch_dir(base: Path, job: str) -> Path:
    """Open MPI's shared-memory directory for the profile start (removed with ``drop``)."""
    path = base / f"resihp-{job}-profile"
    path.mkdir(parents=True, exist_ok=True)
    return path


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ranks_per_node_of(n: int, nodes: int, hosts: bool) -> int:
    """``--nodes K`` on one machine tells the ranks how many share a node; a hostfile's nodes
    are told by their host names."""
    return 0 if hosts else n // nodes


def chosen_layout(record: Mapping[str, Any]) -> str:
    text = record.get("layout")
    if not isinstance(text, str):
        raise SpecError("--layout auto: the profile's choice names no layout")
    return text

