"""Where a rank's step reports go, behind one small interface.

The hooks speak ``Transport``; implementations:

- ``AgentTransport``: the node agent over gRPC, through the control plane's ``AgentClient``
  (bounded queue + background thread: ``report`` never blocks a step);
- ``NullTransport``: no agent reachable — training goes on, one warning says so;
- ``MemoryTransport``: an in-process fake for tests (records reports, feeds commands).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import messages as m

log = logging.getLogger(__name__)


class Transport(Protocol):
    def report(
        self, iteration: int, step_s: float, start_s: float, seqlens: Sequence[Sequence[int]],
        chunks: Sequence[ChunkTiming], epoch: int,
    ) -> bool:
        """Queue one finished iteration; False if it was dropped. Must not block."""
        ...

    def probe(self, probe_s: float) -> None:
        """Queue this rank's compute probe (``trainer_hooks/runtime/probe.py``). Must not block."""
        ...

    def poll_commands(self) -> list[m.Command]:
        """Commands received since the last call, oldest first. Must not block."""
        ...

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None: ...

    def close(self) -> None: ...


class NullTransport:
    """No agent: drops reports, never has commands; one warning for the job (rank 0's)."""

    def __init__(self, rank: int, why: str) -> None:
        self.rank = rank
        log.log(logging.WARNING if rank == 0 else logging.DEBUG,
                "resihp: no node agent (%s); training continues without resilience reporting", why)

    def report(self, iteration: int, step_s: float, start_s: float, seqlens: Sequence[Sequence[int]],
               chunks: Sequence[ChunkTiming], epoch: int) -> bool:
        return True

    def probe(self, probe_s: float) -> None:
        return None

    def poll_commands(self) -> list[m.Command]:
        return []

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        return None

    def close(self) -> None:
        return None


class MemoryTransport:
    """A fake agent in the same process (tests): keeps reports and acks, hands out commands."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reports: list[m.RankReport] = []
        self.acks: list[tuple[int, int, bool, str]] = []  # (seq, iteration, ok, error)
        self.probes: list[float] = []
        self._commands: list[m.Command] = []
        self.closed = False

    def push(self, command: m.Command) -> None:
        with self._lock:
            self._commands.append(command)

    def report(self, iteration: int, step_s: float, start_s: float, seqlens: Sequence[Sequence[int]],
               chunks: Sequence[ChunkTiming], epoch: int) -> bool:
        rep = m.RankReport(-1, epoch, iteration, start_s, step_s, tuple(tuple(s) for s in seqlens), tuple(chunks))
        with self._lock:
            self.reports.append(rep)
        return True

    def probe(self, probe_s: float) -> None:
        with self._lock:
            self.probes.append(probe_s)

    def poll_commands(self) -> list[m.Command]:
        with self._lock:
            out, self._commands = self._commands, []
        return out

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        with self._lock:
            self.acks.append((command.seq, iteration, ok, error))

    def close(self) -> None:
        self.closed = True


class AgentTransport:
    """The node agent via the control plane's AgentClient (its own queue and threads)."""

    def __init__(self, rank: int, address: str, local_rank: int = 0, job: str = "", *, reshapes: bool = False,
                 model_json: str = "", exit_on_peer_failure: bool | None = None) -> None:
        from resihp.trainer_hooks.reporting.agent_client import AgentClient  # grpc only when an agent is used

        self.client = AgentClient(rank, address, local_rank=local_rank, job=job, reshapes=reshapes,
                                  model_json=model_json, exit_on_peer_failure=exit_on_peer_failure).start()

    def report(self, iteration: int, step_s: float, start_s: float, seqlens: Sequence[Sequence[int]],
               chunks: Sequence[ChunkTiming], epoch: int) -> bool:
        return bool(self.client.report(iteration, step_s, start_s=start_s, seqlens=seqlens, chunks=chunks,
                                       epoch=epoch))

    def probe(self, probe_s: float) -> None:
        self.client.probe(probe_s)

    def poll_commands(self) -> list[m.Command]:
        return list(self.client.poll_commands())

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        self.client.ack(command, iteration, ok, error)

    def close(self) -> None:
        self.client.close()


def connect(rank: int, local_rank: int, job: str, address: str | None, *, reshapes: bool = False,
            model_json: str = "", exit_on_peer_failure: bool | None = None) -> Transport:
    """The agent at ``address`` (None/"" = from the environment, as ``resihp launch`` sets it).

    ``reshapes``: this rank's runtime applies a ReconfigCommand (live reconfiguration is installed);
    False (a loop that keeps its own model) makes the job observe-only: findings are printed, never
    acted on. ``model_json``: the ModelSpec the rank trains, as JSON. ``exit_on_peer_failure``:
    end the process (code 75) when a peer dies; None = on exactly for observe-only ranks
    (``$RESIHP_EXIT_ON_PEER_FAILURE`` overrides it)."""
    if not address:
        from resihp.trainer_hooks.reporting.agent_client import agent_address_from_env

        address = agent_address_from_env(rank)
    if not address:
        return NullTransport(rank, "RESIHP_AGENT_ADDR / RESIHP_AGENT_ADDRS are not set")
    return AgentTransport(rank, address, local_rank, job, reshapes=reshapes, model_json=model_json,
                          exit_on_peer_failure=exit_on_peer_failure)
