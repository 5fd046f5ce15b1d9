"""MPI bootstrap into torch.distributed.

MPI (mpi4py) tells every rank who it is, which node it runs on (rank → node map) and where
the rendezvous store lives; torch.distributed then runs the collectives (gloo on CPU, NCCL
when CUDA is present). Every plan epoch joins through its own store prefix
(``resihp/epoch{N}/``), so a regrouped world never sees an older epoch's keys.

Where the store lives. ARCHITECTURE.md wants it outside trainer processes (a trainer rank
that dies must not take the store with it). ``RESIHP_STORE=host:port`` points every rank at
such a store — hosted by the launcher, agent or coordinator, e.g. with
``python -m resihp.trainer_hooks.launch.bootstrap --serve-store`` (prints ``host:port``). Without
it, and only for single-job runs of this issue, global rank 0 hosts the store in a child
process of its own (``ulfm.StoreProcess``: its Python server never waits on the rank's
GIL); such a job cannot survive the loss of rank 0.

Either way the store is launch/store_server.py: it listens on one address (loopback for a
one-node job) and answers only clients holding the ranks' credential, ``$RESIHP_RANK_TOKEN``;
where rank 0 hosts the store and no credential is set, rank 0 draws one and MPI hands it to
the other ranks.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from resihp.trainer_hooks.launch.backends import runs_nccl, world_backend
from resihp.trainer_hooks.launch.rank_env import loopback_ifname
from resihp.trainer_hooks.launch.store_client import AuthStore, credential_from_env
from resihp.trainer_hooks.launch.store_server import CREDENTIAL_ENV, StoreServer
from resihp.trainer_hooks.reconfig.ulfm import StoreProcess

log = logging.getLogger(__name__)

STORE_ENV = "RESIHP_STORE"


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    node: str
    nodes: tuple[str, ...]  # node of every global rank
    backend: str
    device: torch.device
    store_addr: str
    epoch: int
    job_start_s: float  # wall clock (time.time()) every rank agrees on, for job-relative traces

    @property
    def local_world(self) -> int:
        return sum(1 for n in self.nodes if n == self.node)


def mpi_comm() -> Any:
    """MPI.COMM_WORLD (importing mpi4py initialises MPI; a plain `python` run is a world of one)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


BACKEND_ENV = "RESIHP_BACKEND"


def default_backend() -> str:
    """$RESIHP_BACKEND if set (gloo | nccl), else NCCL when CUDA is present, else gloo."""
    chosen = os.environ.get(BACKEND_ENV, "").strip().lower()
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise ValueError(f"{BACKEND_ENV}={chosen!r}: expected gloo or nccl")
        if chosen == "nccl" and not torch.cuda.is_available():
            raise ValueError(f"{BACKEND_ENV}=nccl but CUDA is not available here; use gloo")
        return chosen
    return "nccl" if torch.cuda.is_available() else "gloo"


def host_store(host: str = "127.0.0.1", port: int = 0, credential: str = "") -> StoreServer:
    """The job's store, served on ``host`` only by a thread of this process; the caller keeps
    the returned server alive for the job."""
    return StoreServer(host, port, credential).start()


def _parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{STORE_ENV}={text!r} is not host:port; set it like 127.0.0.1:29500 or unset it")
    return host, int(port)


_frozen = False


def _freeze_startup_objects() -> None:
    """Move what start-up created (torch's, numpy's and MPI's modules, classes and tables:
    ~170K objects, alive as long as the process) out of the cyclic collector's reach, once
    per process, before any model exists. A full collection then scans only what the job
    allocates (146 -> 56 ms measured here), so its pauses weigh less on steps and on live
    reconfigurations (it used to fall inside a switch's downtime)."""
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True


class Bootstrap:
    """One rank's MPI identity and its current torch.distributed world (one per process)."""

    def __init__(self, comm: Any | None = None, backend: str | None = None, timeout_s: float = 60.0) -> None:
        self.comm = comm if comm is not None else mpi_comm()
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self.rank = int(self.comm.Get_rank())
        self.world_size = int(self.comm.Get_size())
        self.node = socket.gethostname()
        self.nodes: tuple[str, ...] = tuple(self.comm.allgather(self.node))
        self.local_rank = sum(1 for r in range(self.rank) if self.nodes[r] == self.node)
        self._hosted_store: StoreProcess | None = None
        self.adopted = False  # the script's own default process group (init_process_group before init)
        self._store_addr = self._agree_store()
        host, port = _parse_addr(self._store_addr)
        self._store = AuthStore(host, port, credential_from_env(), _dt.timedelta(seconds=timeout_s))
        self.job_start_s: float = float(self.comm.bcast(time.time() if self.rank == 0 else None, root=0))
        self.epoch = -1
        _freeze_startup_objects()

    def _agree_store(self) -> str:
        env = os.environ.get(STORE_ENV, "").strip()
        if env:
            _parse_addr(env)
            return env
        addr = None
        credential = credential_from_env()
        if self.rank == 0:
            single_node = len(set(self.nodes)) == 1
            host = "127.0.0.1" if single_node else socket.gethostbyname(self.node)
            credential = credential or secrets.token_hex(32)
            self._hosted_store = StoreProcess(host, credential=credential)
            addr = f"{host}:{self._hosted_store.port}"
            log.info("rank 0 hosts the rendezvous store at %s (set %s to host it outside the trainers)", addr, STORE_ENV)
        # the credential rank 0 drew reaches the others over MPI; it stays in this process's
        # environment, where later clients of the store (live reconfiguration) find it
        addr, credential = self.comm.bcast((addr, credential), root=0)
        os.environ[CREDENTIAL_ENV] = credential
        return str(addr)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl" and self.adopted:  # the script chose its device (cuda:LOCAL_RANK, torchrun style)
            return torch.device("cuda", torch.cuda.current_device())
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    def init_epoch(self, epoch: int) -> WorldInfo:
        """(Re)create the default process group for a plan epoch, with a fresh store prefix."""
        if epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} is not newer than the current epoch {self.epoch}")
        if self.epoch < 0 and dist.is_initialized():
            return self._adopt(epoch)
        if dist.is_initialized():
            dist.destroy_process_group()
            self.adopted = False
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        # gloo runs under NCCL too, for CPU tensors (launch/backends.py)
        if len(set(self.nodes)) == 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname()
        store = PrefixStore(f"resihp/epoch{epoch}/", self._store)
        dist.init_process_group(
            world_backend(self.backend), store=store, rank=self.rank, world_size=self.world_size,
            timeout=_dt.timedelta(seconds=self.timeout_s),
        )
        self.epoch = epoch
        return self.info()

    def _adopt(self, epoch: int) -> WorldInfo:
        """The script called ``init_process_group`` itself (torchrun style, from the env://
        variables ``resihp launch`` sets): keep its group, after checking it is MPI's world."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) != (self.rank, self.world_size):
            raise RuntimeError(
                f"the script's process group has rank {rank} of {world} but MPI says rank {self.rank} of "
                f"{self.world_size}; under `resihp launch` take RANK / WORLD_SIZE from the environment it sets"
            )
        backend = str(dist.get_backend()).lower()
        self.backend = "nccl" if runs_nccl(backend) else "gloo"
        self.adopted = True
        self.epoch = epoch
        log.info("rank %d reuses the script's process group (%s, %d ranks)", rank, backend, world)
        return self.info()

    def info(self) -> WorldInfo:
        return WorldInfo(
            rank=self.rank, world_size=self.world_size, local_rank=self.local_rank, node=self.node,
            nodes=self.nodes, backend=self.backend, device=self.device, store_addr=self._store_addr,
            epoch=self.epoch, job_start_s=self.job_start_s,
        )

    def close(self, barrier: bool = True) -> None:
        """Leave torch.distributed. ``barrier``: wait for every rank first (rank 0 may host the
        store, which must outlive every rank's last use of it); skip it when the store is external
        and the MPI world may have lost ranks."""
        if dist.is_initialized() and not self.adopted:  # the script's own group is the script's to end
            dist.destroy_process_group()
        if barrier:
            self.comm.Barrier()
        if self._hosted_store is not None:
            self._hosted_store.close()
            self._hosted_store = None


def main(argv: list[str] | None = None) -> int:
    """Host a rendezvous store outside the trainers: prints host:port, serves until killed."""
    parser = argparse.ArgumentParser(prog="python -m resihp.trainer_hooks.launch.bootstrap")
    parser.add_argument("--serve-store", action="store_true",
                        help="host the job's store and print its host:port (credential: $RESIHP_RANK_TOKEN)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.serve_store:
        parser.error("nothing to do; pass --serve-store")
    credential = os.environ.get(CREDENTIAL_ENV, "")
    if not credential:
        parser.error(f"set ${CREDENTIAL_ENV} (the ranks' credential; never on the command line)")
    store = host_store(args.host, args.port, credential)
    print(f"{args.host}:{store.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()

if __name__ == "__main__":
    sys.exit(main())
