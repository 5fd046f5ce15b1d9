"""What the coordinator's core keeps per rank, per agent connection and per pending command."""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

from resihp.coordinator.model.trace import OpState
from resihp.coordinator.protocol import messages as m


@dataclass
class RankInfo:
    rank: int
    node: str = ""
    pid: int = 0
    local_rank: int = 0
    last_seen: float | None = None  # coordinator clock
    iteration: int = -1
    step_s: float = 0.0
    iteration_end_s: float = 0.0  # wall clock (the rank's) at which ``iteration`` ended
    dead: bool = False
    finished: bool = False
    dead_reason: str = ""
    reshapes: bool | None = None  # its hello: it applies a ReconfigCommand; None = not said (coordinator/service/observe.py)
    exit_code: int | None = None  # as its agent saw it exit (RankExit.code)
    op: OpState | None = None  # the op its latest heartbeat named (hang localisation)
    op_at: float | None = None  # coordinator clock of that heartbeat
    op_since: float | None = None  # coordinator clock of the first heartbeat that named that op (its seq)


@dataclass
class AgentConn:
    agent_id: str
    node: str
    ranks: set[int] = field(default_factory=set)
    outbox: queue.Queue[m.CoordinatorBatch | None] = field(default_factory=queue.Queue)
    streaming: bool = False
    sampler_degraded: bool = False
    sampler_status: str = ""


@dataclass
class Pending:
    command: m.ReconfigCommand
    awaiting: set[int]
    issued_at: float
    attempts: int = 1
    applied_at: int = -1  # the latest iteration an ack says the plan took effect (apply_at or later)
    adopted_at: int | None = None  # the engine took the plan before every ack came (its records came first)


def record_gpu_sample(metrics: Any, events: Any, node: str, job: str, g: m.GpuSample) -> None:
    """An agent's NVML sample of one GPU: gauges, and an event per XID error."""
    lab = {"gpu": g.gpu, "UUID": g.uuid, "modelName": g.model_name, "Hostname": node, "job": job}
    metrics.set("resihp_gpu_sm_clock_hertz", g.sm_clock_hz, lab)
    metrics.set("resihp_gpu_temperature_celsius", g.temperature_celsius, lab)
    metrics.set("resihp_gpu_power_usage_watts", g.power_watts, lab)
    metrics.set("resihp_gpu_clock_event_reasons", g.clock_event_reasons, lab)
    metrics.set("resihp_gpu_ecc_uncorrected_total", g.ecc_uncorrected_total, lab)
    if g.xid_events:
        metrics.set("resihp_gpu_xid_last", g.xid_events[-1], lab)
        events.emit("gpu-xid", node=node, gpu=g.gpu, xids=list(g.xid_events),
                    reason=f"XID {list(g.xid_events)} on {node} GPU {g.gpu}")
