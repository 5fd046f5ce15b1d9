"""Control-plane messages as plain frozen dataclasses.

Everything outside ``codec.py`` speaks these types, never protobuf ones, so the pure
parts (joiner, state machine, engine) can be tested without gRPC. Times are seconds on
the sender's wall clock (Unix epoch) unless a field says otherwise. Pure: no grpc.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import EXIT_UNKNOWN as EXIT_UNKNOWN  # re-exported: RankExit.code's "unknown"
from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.model.trace import OpState as OpState  # re-exported: RankHeartbeat.op
from resihp.coordinator.model.trace import describe_exit as describe_exit


@dataclass(frozen=True)
class RankReport:
    """One rank's finished iteration. ``seqlens[m]`` are the packed document lengths of
    micro-batch m of the rank's replica (every rank of a replica reports the same)."""

    rank: int
    epoch: int
    iteration: int
    start_s: float
    step_s: float
    seqlens: tuple[tuple[int, ...], ...] = ()
    chunks: tuple[ChunkTiming, ...] = ()


@dataclass(frozen=True)
class RankHeartbeat:
    rank: int
    time_s: float
    iteration: int = -1  # last reported iteration; -1 = none yet
    op: OpState | None = None  # the op the rank is in (hang localisation); None: it names none


@dataclass(frozen=True)
class RankProbe:
    """A rank's compute probe (coordinator/detector/probe.py): ``probe_s`` seconds for a fixed
    few GEMMs on its device, timed like its compute chunks; ``time_s`` when it ended."""

    rank: int
    time_s: float
    probe_s: float


@dataclass(frozen=True)
class GpuSample:
    gpu: int
    time_s: float
    uuid: str = ""
    model_name: str = ""
    sm_clock_hz: float = 0.0
    sm_clock_max_hz: float = 0.0
    clock_event_reasons: int = 0
    temperature_celsius: float = 0.0
    power_watts: float = 0.0
    ecc_corrected_total: int = 0
    ecc_uncorrected_total: int = 0
    xid_events: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProcessSample:
    rank: int
    pid: int
    time_s: float
    cpu_seconds_total: float
    rss_bytes: int


@dataclass(frozen=True)
class RankExit:
    rank: int
    pid: int
    time_s: float
    code: int = EXIT_UNKNOWN  # exit status where known; negative = killed by signal -code
    clean: bool = False  # the rank said goodbye first: finished, not failed


@dataclass(frozen=True)
class LocalRank:
    rank: int
    local_rank: int = 0
    pid: int = 0
    # the rank's runtime applies a ReconfigCommand (live reconfiguration installed); False, the
    # default, is a loop that keeps its own model: its job is observed, never reshaped
    reshapes: bool = False
    model_json: str = ""  # the ModelSpec the rank trains, as JSON ("" = not said)


# --- commands (coordinator -> hooks) --------------------------------------------------
@dataclass(frozen=True)
class ReconfigCommand:
    """Switch to ``plan`` (whose epoch is ``epoch``) at iteration ``apply_at``."""

    epoch: int
    plan: Plan
    apply_at: int
    reason: str = ""
    seq: int = 0
    ranks: tuple[int, ...] = ()  # empty = every rank
    issued_s: float = 0.0


@dataclass(frozen=True)
class ThrottleCommand:
    """Fault injection: make the target rank's compute ``factor`` times slower (1.0 clears).
    The trainer runtime implements the throttle; the hook only delivers it."""

    epoch: int
    factor: float
    apply_at: int
    reason: str = ""
    seq: int = 0
    ranks: tuple[int, ...] = ()
    issued_s: float = 0.0


@dataclass(frozen=True)
class DrainCommand:
    """Stop training cleanly at ``apply_at`` (checkpoint and exit)."""

    epoch: int
    apply_at: int
    reason: str = ""
    seq: int = 0
    ranks: tuple[int, ...] = ()
    issued_s: float = 0.0


@dataclass(frozen=True)
class NoticeCommand:
    """Information for the trainers, never an order: the hook prints ``text`` (not applied, not
    acknowledged). ``kind`` "finding": a finding on an observe-only job; "peer-failure": rank
    ``rank`` died (``cause``, exit ``code`` as in RankExit, at ``time_s``, after ``iteration``)."""

    epoch: int
    text: str
    apply_at: int = 0
    reason: str = ""
    seq: int = 0
    ranks: tuple[int, ...] = ()  # empty = every rank
    issued_s: float = 0.0
    kind: str = "finding"  # finding | peer-failure
    rank: int = -1
    cause: str = ""
    code: int = 0
    time_s: float = 0.0
    iteration: int = -1


NOTICE_KINDS = ("finding", "peer-failure")
Command = ReconfigCommand | ThrottleCommand | DrainCommand | NoticeCommand
# An acknowledgement error that starts with this says the job ended before the command's
# apply_at: nothing failed, and there is nothing left to plan for.
JOB_ENDED = "job ended: "


def command_kind(cmd: Command) -> str:
    if isinstance(cmd, ReconfigCommand):
        return "reconfigure"
    if isinstance(cmd, ThrottleCommand):
        return "throttle"
    if isinstance(cmd, NoticeCommand):
        return "notice"
    return "drain"


def command_targets(cmd: Command, rank: int) -> bool:
    return not cmd.ranks or rank in cmd.ranks


@dataclass(frozen=True)
class Ack:
    rank: int
    seq: int
    epoch: int
    iteration: int
    ok: bool = True
    error: str = ""
    time_s: float = 0.0


# --- agent <-> coordinator ------------------------------------------------------------
@dataclass(frozen=True)
class AgentHeartbeat:
    time_s: float
    ranks: tuple[RankHeartbeat, ...] = ()
    sampler_degraded: bool = False
    sampler_status: str = ""


@dataclass(frozen=True)
class InjectResult:
    kind: str
    rank: int
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class AgentBatch:
    """One message up the agent's stream."""

    agent_id: str = ""
    node: str = ""
    reports: tuple[RankReport, ...] = ()
    acks: tuple[Ack, ...] = ()
    exits: tuple[RankExit, ...] = ()
    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    joined: tuple[LocalRank, ...] = ()
    injections: tuple[InjectResult, ...] = ()
    heartbeat: AgentHeartbeat | None = None
    probes: tuple[RankProbe, ...] = ()
    # the agent's fast path: reports already validated by the codec, forwarded in their wire
    # form (protobuf ``RankReport``) instead of being converted back; opaque outside codec.py
    raw_reports: tuple[Any, ...] = ()


FAILED_PREFIX = re.compile(r"^fail-stop of ranks \[([0-9, ]*)\]")


def failed_ranks(reason: str) -> tuple[int, ...]:
    """The ranks a fail-stop plan's reason names as dead (``fail-stop of ranks [6, 7]; …``); ()
    for any other plan. Left out of a plan is not dead: an excluded rank is alive."""
    found = FAILED_PREFIX.match(reason)
    return tuple(int(x) for x in found.group(1).split(",") if x.strip()) if found else ()


@dataclass(frozen=True)
class KillOrder:
    rank: int
    reason: str = ""
    fence: bool = False  # the rank was declared dead while its process may live: make sure it does not
    pid: int = 0  # that process, for an agent that has not met it (restarted since)


@dataclass(frozen=True)
class CoordinatorBatch:
    commands: tuple[Command, ...] = ()
    kills: tuple[KillOrder, ...] = ()


@dataclass(frozen=True)
class Registration:
    node: str
    job: str
    ranks: tuple[LocalRank, ...] = ()
    address: str = ""
    sampler_degraded: bool = False
    sampler_status: str = ""


@dataclass(frozen=True)
class Welcome:
    agent_id: str
    epoch: int
    last_seq: int
    world_size: int
    heartbeat_interval_s: float
    plan: Plan | None = None


# --- findings, as the coordinator reports them ----------------------------------------
@dataclass(frozen=True)
class FindingInfo:
    """A detector finding as the control plane carries it (events, admin, metrics).
    Decoupled from the detector's own type so the service works with any engine."""

    iteration: int
    kind: str  # fail-slow | fail-stop | recovered | degraded (a fail-slow under the impact floor)
    ranks: tuple[int, ...]
    cause: str = "unknown"
    factor: float = 1.0
    reason: str = ""
    time_s: float = 0.0
    stage: int | None = None
    replica: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration": self.iteration, "kind": self.kind, "ranks": list(self.ranks), "cause": self.cause,
            "factor": round(self.factor, 6), "reason": self.reason, "time_s": round(self.time_s, 6),
            "stage": self.stage, "replica": self.replica,
        }
        out.update(self.extra)
        return out
