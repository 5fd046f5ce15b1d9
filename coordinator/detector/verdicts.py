"""The detector's vocabulary: rank states, the transitions between them, findings. Pure."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

# degraded: a fail-slow whose predicted cost is below DetectorConfig.impact_floor (not acted on)
FindingKind = Literal["fail-slow", "fail-stop", "recovered", "degraded"]


class RankState(IntEnum):
    HEALTHY = 0
    SUSPECT = 1
    SLOW = 2
    DEAD = 3


# the only transitions the detector makes, and what drives each
TRANSITIONS: dict[tuple[RankState, RankState], str] = {
    (RankState.HEALTHY, RankState.SUSPECT): "ratio above threshold",
    (RankState.SUSPECT, RankState.HEALTHY): "ratio back below threshold before confirmation",
    (RankState.SUSPECT, RankState.SLOW): "confirm_iters consecutive suspect iterations (fail-slow finding)",
    (RankState.SLOW, RankState.HEALTHY): "recover_iters consecutive normal iterations (recovered finding)",
    (RankState.HEALTHY, RankState.DEAD): "exit event or heartbeat timeout (fail-stop finding)",
    (RankState.SUSPECT, RankState.DEAD): "exit event or heartbeat timeout (fail-stop finding)",
    (RankState.SLOW, RankState.DEAD): "exit event or heartbeat timeout (fail-stop finding)",
}


@dataclass(frozen=True)
class Finding:
    iteration: int
    kind: FindingKind
    ranks: tuple[int, ...]
    stage: int | None
    replica: int | None
    tp_group: tuple[int, ...] | None
    factor: float
    cause: str  # compute | communication | process-exit | heartbeat | unknown
    reason: str
    evidence: Mapping[str, float] = field(default_factory=dict)
    time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration, "kind": self.kind, "ranks": list(self.ranks), "stage": self.stage,
            "replica": self.replica, "factor": round(self.factor, 4), "reason": self.reason, "cause": self.cause,
            "tp_group": None if self.tp_group is None else list(self.tp_group),
            "evidence": {k: round(v, 6) for k, v in self.evidence.items()}, "time_s": round(self.time_s, 6),
        }
