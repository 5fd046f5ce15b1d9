"""Fail-stop recovery on MPI with ULFM: revoke, shrink, agree, and a fresh gloo world.

The job runs under ``mpirun`` with ``FT_MPIRUN_ARGS`` (``--with-ft ulfm``, the heartbeat
detector in its own thread — without it a live rank that sits in a gloo collective for a
few seconds is declared dead — and a detector timeout long enough for a loaded machine). When a rank dies, survivors see either a
gloo error (peer reset, or the group's — short — timeout) or an MPI process-failure error.
Each survivor then calls ``shrink``: ``Revoke`` interrupts peers still blocked in MPI on the
old communicator, ``Shrink`` gives the survivors a communicator of their own, and one
allgather on it agrees on the last step every survivor completed and the next plan epoch.
``bootstrap_gloo`` then builds a torch.distributed gloo group over the survivors with a
fresh store prefix per epoch.

The store must not live in a trainer rank (it would die with it): ``StoreProcess``
starts a small separate process hosting it (``python -m resihp.trainer_hooks.reconfig.ulfm
serve-store``), as the launcher, the agent or a test does: launch/store_server.py, bound to the
one address it is given and answering only clients that hold the ranks' credential.

Ranks are *logical*: a rank keeps its job-wide number across shrinks, and ``MpiWorld.ranks``
maps new communicator positions back to it (plans and the reshard planner use logical ranks).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

STORE_ENV = "RESIHP_STORE_ADDR"  # host:port of the job's TCPStore, set by the launcher

# mpirun arguments for a job that survives dead ranks. A killed rank is reported by the
# runtime (PRRTE sees its child exit) within milliseconds, with or without ULFM's heartbeat
# detector. The detector is off: its thread (mpi_ft_detector_thread) segfaulted ranks in
# MPI start-up (8 of 8 eight-rank starts on 2026-11-30, 0 of 8 with the thread off or the
# detector off), and without its thread it declares a rank dead that spends its timeout
# outside MPI calls (a rank computing in torch, a spare waiting). Hung ranks are the
# coordinator's heartbeat timeout's to find.
FT_MPIRUN_ARGS: tuple[str, ...] = ("--with-ft", "ulfm")


class RecoveryError(RuntimeError):
    """The survivors could not form a new world (repeated failures during the shrink)."""


@dataclass(frozen=True)
class MpiWorld:
    """A fault-tolerant communicator and who is in it."""

    comm: Any  # mpi4py MPI.Comm with ERRORS_RETURN
    ranks: tuple[int, ...]  # logical rank of every member, in communicator order
    epoch: int  # plan epoch this membership belongs to; names the store prefix
    agreed_step: int = -1  # last step every member completed (after a shrink)
    failed: tuple[int, ...] = ()  # logical ranks lost in the last shrink
    attempts: int = 0  # shrink attempts the last recovery took (> 1: a failure during recovery)

    @property
    def rank(self) -> int:
        """This process's logical rank."""
        return self.ranks[int(self.comm.Get_rank())]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def pg_rank_of(self) -> dict[int, int]:
        """Logical rank -> rank in this world (and in the gloo group built from it)."""
        return {r: i for i, r in enumerate(self.ranks)}


@dataclass(frozen=True)
class GlooWorld:
    pg: Any  # torch.distributed ProcessGroupGloo
    rank: int  # rank within pg
    size: int
    prefix: str
    pg_rank_of: dict[int, int]  # logical rank -> pg rank


def ft_world(comm: Any = None, epoch: int = 0) -> MpiWorld:
    """Duplicate ``comm`` (COMM_WORLD by default) with errors returned instead of aborting."""
    from mpi4py import MPI

    comm = (comm or MPI.COMM_WORLD).Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return MpiWorld(comm, tuple(comm.allgather(comm.Get_rank())), epoch)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer died (MPI process failure / revoked comm, a gloo I/O error, an
    NCCL communicator aborted or failed by its remote peer)."""
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is a dependency of the train extra
        MPI = None  # type: ignore[assignment]
    if MPI is not None and isinstance(exc, MPI.Exception):
        return exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    from resihp.trainer_hooks.reporting.deaths import PeerDeclaredDead

    if isinstance(exc, PeerDeclaredDead):
        return True
    text = str(exc)
    # "wait timeout": a store rendezvous (e.g. new_group) a dead peer never joins (DistStoreError)
    # NCCL: a communicator aborted because a member was declared dead (runtime/abort_on_death.py),
    # or one whose remote peer failed
    markers = ("Connection reset", "Connection closed", "Timed out", "Broken pipe", "Socket closed", "pair.cc",
               "pair closure", "Application timeout", "Connection refused", "wait timeout",
               "NCCL communicator was aborted", "ncclRemoteError", "Communicator was aborted")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


def failed_processes(world: MpiWorld) -> frozenset[int]:
    """Logical ranks of ``world`` whose process MPI knows to have failed, without a collective:
    ULFM's ``Get_failed`` after an ``Iprobe`` (which drives MPI's progress, where the runtime's
    notice of a dead process lands: 5-45 ms after a SIGKILL here). Empty where MPI has no ULFM
    or says nothing. A job run without a coordinator has no death notices; this is how a
    rank waiting in the store for a peer (a switch's arrival, a group's rendezvous) learns
    the peer is gone, instead of at its timeout."""
    from mpi4py import MPI

    comm = world.comm
    try:
        comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    except MPI.Exception:
        pass  # a failure pending or the communicator revoked: Get_failed says who
    except Exception:  # noqa: BLE001 - a communicator that cannot be probed knows nothing
        return frozenset()
    try:
        group = comm.Get_failed()
    except Exception:  # noqa: BLE001 - an MPI without ULFM raises here, as does a freed communicator
        return frozenset()
    try:
        n = group.Get_size()
        if n == 0:
            return frozenset()
        where = MPI.Group.Translate_ranks(group, list(range(n)), comm.Get_group())
        return frozenset(world.ranks[i] for i in where if 0 <= i < len(world.ranks))
    finally:
        group.Free()


def shrink(
    world: MpiWorld, last_step: int, *, max_attempts: int = 3, fault: Callable[[str], None] | None = None
) -> MpiWorld:
    """Revoke the broken communicator, shrink to the survivors, agree on the restart point.

    Every survivor must call this (the one that saw the failure first revokes; the others
    are pulled out of MPI by the revoke, or out of gloo by its error). Returns a world whose
    ``agreed_step`` is the minimum ``last_step`` over survivors and whose epoch is one past
    the largest epoch any survivor knew. A failure during the shrink is caught by a
    fault-tolerant agreement (``Agree``), which every survivor leaves with the same verdict,
    and the shrink is redone. ``fault``: fault injection for tests, called with "shrunk"
    right after each ``Shrink``.
    """
    from mpi4py import MPI

    comm = world.comm
    me = world.rank
    started = time.monotonic()
    for attempt in range(1, max_attempts + 1):
        try:
            comm.Revoke()
        except MPI.Exception:
            pass  # already revoked by a peer
        try:
            new = comm.Shrink()
        except MPI.Exception as exc:
            raise RecoveryError(f"rank {me}: MPI could not shrink the communicator: {exc}") from exc
        new.Set_errhandler(MPI.ERRORS_RETURN)
        if fault is not None:
            fault("shrunk")
        # who survived, in order, with their last step and epoch; the allgather alone may
        # succeed on some ranks and fail on others, so a uniform Agree settles whether it held
        infos: list[tuple[int, int, int]] = []
        try:
            infos = new.allgather((me, last_step, world.epoch))
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise RecoveryError(f"rank {me}: agreement after shrink failed: {exc}") from exc
        try:
            ok = new.Agree(1 if infos else 0)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise RecoveryError(f"rank {me}: agreement after shrink failed: {exc}") from exc
            ok = 0
        if not ok:
            if attempt == max_attempts:
                raise RecoveryError(f"rank {me}: ranks kept failing during {max_attempts} shrink attempts")
            log.warning("rank %d: another failure during shrink attempt %d; shrinking again", me, attempt)
            comm = new
            continue
        ranks = tuple(r for r, _, _ in infos)
        step = min(s for _, s, _ in infos)
        epoch = max(e for _, _, e in infos) + 1
        failed = tuple(sorted(set(world.ranks) - set(ranks)))
        log.info(
            "rank %d: shrank %d -> %d ranks in %.3f s (lost %s, %d attempt(s)); agreed step %d, epoch %d",
            me, world.size, len(ranks), time.monotonic() - started, list(failed), attempt, step, epoch,
        )
        return MpiWorld(new, ranks, epoch, step, failed, attempt)
    raise RecoveryError(f"rank {me}: could not shrink after {max_attempts} attempts")  # pragma: no cover


def bootstrap_gloo(world: MpiWorld, store_addr: str | None = None, *, timeout_s: float = 5.0) -> GlooWorld:
    """A gloo process group over ``world``'s members, keyed by a fresh per-epoch store prefix.

    ``store_addr`` is ``host:port`` of the job's store, hosted outside the trainer ranks (default:
    ``$RESIHP_STORE_ADDR``; credential: ``$RESIHP_RANK_TOKEN``). Keep ``timeout_s`` short: a rank
    not directly connected to a dead peer learns of the failure only when its collective times out.
    """
    import torch.distributed as dist

    from resihp.trainer_hooks.launch.store_client import connect

    addr = store_addr or os.environ.get(STORE_ENV)
    if not addr or ":" not in addr:
        raise RecoveryError(f"no store address: pass store_addr='host:port' or set ${STORE_ENV}")
    store = connect(addr, timedelta(seconds=max(timeout_s, 10.0)))
    prefix = f"resihp/epoch{world.epoch}/"
    rank = world.comm.Get_rank()
    scoped = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(scoped, rank, world.size, timedelta(seconds=timeout_s))
    return GlooWorld(pg, rank, world.size, prefix, world.pg_rank_of())


def recover(
    world: MpiWorld, last_step: int, store_addr: str | None = None, *, timeout_s: float = 5.0
) -> tuple[MpiWorld, GlooWorld]:
    """``shrink`` then ``bootstrap_gloo``: what a survivor calls once it has seen a peer die."""
    new = shrink(world, last_step)
    return new, bootstrap_gloo(new, store_addr, timeout_s=timeout_s)


class StoreProcess:
    """The job's store (launch/store_server.py) in its own small process, so no trainer's death
    takes it with it. It listens on ``host`` only and answers only clients holding
    ``credential`` (default: a fresh random one; ``client_env()`` is what a rank needs).

    The child exits when this object is closed (its stdin reaches EOF) or its parent dies.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0,
                 credential: str | None = None, env: Mapping[str, str] | None = None) -> None:

        self.credential = credential or secrets.token_hex(32)
        self.base_env = dict(os.environ if env is None else env)  # e.g. RESIHP_JOB: the job's processes are found by it
        self.start_timeout_s = start_timeout_s
        self.host, self.port = host, port
        self.proc = self._spawn(port)

    def _spawn(self, port: int) -> subprocess.Popen[str]:
        from resihp.trainer_hooks.launch.store_server import CREDENTIAL_ENV

        proc = subprocess.Popen(  # the credential travels in the environment, never on the command line
            [sys.executable, "-m", "resihp.trainer_hooks.reconfig.ulfm", "serve-store", "--host", self.host,
             "--port", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**self.base_env, CREDENTIAL_ENV: self.credential},
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.start_timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            proc.wait()
            raise RecoveryError(f"the store process did not report its address within {self.start_timeout_s} s")
        info = json.loads(line)
        self.host = str(info["host"])
        self.port = int(info["port"])
        return proc

    def restart(self) -> subprocess.Popen[str]:
        """A fresh store on the same address and credential, after this one died: clients
        reconnect to it (store_client.AuthStore); what the old one held is gone, so rendezvous
        in flight fail as a peer failure would, and the next epoch starts from an empty store."""
        self.proc = self._spawn(self.port)
        return self.proc

    def client_env(self) -> dict[str, str]:
        """The variables a rank needs to use this store: its address and the credential."""
        from resihp.trainer_hooks.launch.store_server import CREDENTIAL_ENV

        return {STORE_ENV: self.addr, CREDENTIAL_ENV: self.credential}

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resihp.trainer_hooks.reconfig.ulfm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve-store", help="host the job's store until stdin closes; print {host, port} as JSON "
                                               "(credential: $RESIHP_RANK_TOKEN)")
    serve.add_argument("--host", default="127.0.0.1", help="the one address it listens on")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)

    from resihp.trainer_hooks.launch import store_server

    return store_server.main(["--host", args.host, "--port", str(args.port)])

if __name__ == "__main__":
    sys.exit(main())
