"""torchrun's environment for a rank started by ``mpirun``: ``python -m
resihp.trainer_hooks.launch.rank_env -- CMD ...`` sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, TORCHELASTIC_RUN_ID, OMP_NUM_THREADS=1 where
several ranks share a node and the user set none (as torchrun does), keeps the MASTER_ADDR /
MASTER_PORT the launcher exported, then execs CMD in the same process (same
pid: the node agent's pid watch sees the training process itself). The job's store answers
only clients with the ranks' credential, so the script's ``env://`` rendezvous is pointed at
an authenticated client of it (env_rendezvous.py).

A script written for torchrun (``init_process_group("gloo")`` from env://, ``int(os.environ
["RANK"])``; nanoGPT decides DDP by whether RANK is set) then runs unmodified under
``resihp launch``. Values come from Open MPI's OMPI_COMM_WORLD_* variables (PMIx's PMIX_RANK
as a fallback for the global rank).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"


class RankEnvError(RuntimeError):
    """The process was not started by mpirun (no OMPI_COMM_WORLD_* variables)."""


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        text = environ.get(name, "").strip()
        if text:
            try:
                return int(text)
            except ValueError:
                raise RankEnvError(f"{name}={text!r} is not an integer") from None
    return None


def torchrun_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun would set for this rank, from Open MPI's."""
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
    world = _int(environ, "OMPI_COMM_WORLD_SIZE")
    if rank is None or world is None:
        raise RankEnvError("no OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE: start this under mpirun "
                           "(resihp launch does)")
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_rank is None or local_world is None:
        local_rank, local_world = rank, world  # one node
    out = {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        # torchrun's node index and role (one role, "default"); node index assumes equal nodes
        "GROUP_RANK": str(rank // max(1, local_world)), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": environ.get("RESIHP_JOB", "none"),
    }
    for name in (MASTER_ADDR_ENV, MASTER_PORT_ENV):
        if environ.get(name):
            out[name] = environ[name]
    if local_world > 1 and not environ.get("OMP_NUM_THREADS"):
        # as torchrun does: several ranks on one node, each with a thread per core, fight over
        # the cores (the user's own setting is kept)
        out["OMP_NUM_THREADS"] = "1"
    return out


def loopback_ifname() -> str:
    """This machine's loopback interface (gloo's device for a one-node job)."""
    import socket

    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m resihp.trainer_hooks.launch.rank_env -- CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(torchrun_env(os.environ))
    except RankEnvError as exc:
        print(f"resihp rank_env: {exc}", file=sys.stderr)
        return 2
    from resihp.trainer_hooks.launch.env_rendezvous import site_env

    os.environ.update(site_env(os.environ))  # the script's env:// joins the job's authenticated store
    return exec_command(args, "rank_env")


def exec_command(cmd: Sequence[str], shim: str) -> int:
    """Replace this process with ``cmd`` (same pid: the node agent's pid watch sees the training
    process itself); 127 with the reason when it cannot be run."""
    try:
        os.execvp(cmd[0], list(cmd))
    except OSError as exc:
        print(f"resihp {shim}: cannot run {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
