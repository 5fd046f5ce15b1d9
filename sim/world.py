"""The simulated hardware: which devices are alive, how slow each one computes, how slow
each node's network is. Fault events change it; policies read it through the perf model.

The *true* state lives here. What a policy knows about it (after detection) is the
policy's business; the engine only hands every policy the same true state. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FaultKind = Literal["fail-stop", "fail-slow"]
SlowKind = Literal["compute", "communication"]


@dataclass(frozen=True)
class FailStop:
    """A device or node stops at ``time_s``; it is usable again ``repair_s`` later
    (inf = never within the run). ``ranks`` are the devices that went down."""

    time_s: float
    ranks: tuple[int, ...]
    cause: str = "unknown"
    scope: str = "gpu"  # gpu | node | process
    repair_s: float = float("inf")

    @property
    def kind(self) -> FaultKind:
        return "fail-stop"


@dataclass(frozen=True)
class FailSlow:
    """Devices compute (``compute``) or a node's network runs (``communication``)
    ``factor`` times slower from ``time_s`` for ``duration_s`` seconds."""

    time_s: float
    ranks: tuple[int, ...]
    factor: float
    duration_s: float
    slow_kind: SlowKind = "compute"
    cause: str = "unknown"

    @property
    def kind(self) -> FaultKind:
        return "fail-slow"


Fault = FailStop | FailSlow


@dataclass(frozen=True)
class WorldEvent:
    """One change of the true state: a fault starting or ending."""

    time_s: float
    fault: Fault
    fault_id: int
    start: bool  # False: the device is repaired / the slowdown is over

    @property
    def label(self) -> str:
        what = self.fault.kind if self.start else ("repair" if isinstance(self.fault, FailStop) else "recovery")
        return f"{what}#{self.fault_id}"


@dataclass
class World:
    """Mutable true state of ``world_size`` devices, ``gpus_per_node`` to a node."""

    world_size: int
    gpus_per_node: int
    down: dict[int, set[int]] = field(default_factory=dict)  # rank -> ids of fail-stops holding it down
    slow: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> {fault id: compute factor}
    net: dict[int, dict[int, float]] = field(default_factory=dict)  # node -> {fault id: comm factor}
    version: int = 0  # bumped on every change; caches key on it

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return (self.world_size + self.gpus_per_node - 1) // self.gpus_per_node

    # --- queries --------------------------------------------------------------------------
    def alive(self, rank: int) -> bool:
        return not self.down.get(rank)

    def compute_factor(self, rank: int) -> float:
        f = self.slow.get(rank)
        return max(f.values()) if f else 1.0

    def speed(self, rank: int) -> float:
        """Normalised compute speed; 0 when the device is down."""
        return 0.0 if not self.alive(rank) else 1.0 / self.compute_factor(rank)

    def net_factor(self, node: int) -> float:
        f = self.net.get(node)
        return max(f.values()) if f else 1.0

    def dead_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, ids in self.down.items() if ids))

    def slow_ranks(self) -> dict[int, float]:
        return {r: self.compute_factor(r) for r, f in self.slow.items() if f}

    def slow_nodes(self) -> dict[int, float]:
        return {n: self.net_factor(n) for n, f in self.net.items() if f}

    def healthy_compute_fraction(self) -> float:
        """Σ speed / world size: the compute the job could use at best (network ignored,
        so the bound built on it is the stricter one)."""
        lost = 0.0
        for r in set(self.down) | set(self.slow):
            lost += 1.0 - self.speed(r)
        return max(0.0, 1.0 - lost / self.world_size)

    def fingerprint(self) -> tuple[object, ...]:
        """A hashable summary of everything that differs from a healthy world."""
        return (
            tuple(self.dead_ranks()),
            tuple(sorted(self.slow_ranks().items())),
            tuple(sorted(self.slow_nodes().items())),
        )

    def faulty(self) -> tuple[frozenset[int], frozenset[int]]:
        """(ranks that are down or slow, nodes whose network is slow), cached per version."""
        cached = self.__dict__.get("_faulty")
        if cached is not None and cached[0] == self.version:
            return cached[1], cached[2]
        ranks = frozenset(r for r, ids in self.down.items() if ids) | frozenset(r for r, f in self.slow.items() if f)
        nodes = frozenset(n for n, f in self.net.items() if f)
        self.__dict__["_faulty"] = (self.version, ranks, nodes)
        return ranks, nodes

    def clean(self) -> bool:
        return not (self.dead_ranks() or self.slow_ranks() or self.slow_nodes())

    # --- changes --------------------------------------------------------------------------
    def apply(self, ev: WorldEvent) -> None:
        f = ev.fault
        for r in f.ranks:
            if not 0 <= r < self.world_size:
                raise ValueError(f"fault #{ev.fault_id} names rank {r}, outside 0..{self.world_size - 1}")
        if isinstance(f, FailStop):
            for r in f.ranks:
                ids = self.down.setdefault(r, set())
                (ids.add if ev.start else ids.discard)(ev.fault_id)
                if not ids:
                    del self.down[r]
        elif f.slow_kind == "compute":
            for r in f.ranks:
                d = self.slow.setdefault(r, {})
                if ev.start:
                    d[ev.fault_id] = f.factor
                else:
                    d.pop(ev.fault_id, None)
                if not d:
                    del self.slow[r]
        else:
            for node in sorted({self.node_of(r) for r in f.ranks}):
                d = self.net.setdefault(node, {})
                if ev.start:
                    d[ev.fault_id] = f.factor
                else:
                    d.pop(ev.fault_id, None)
                if not d:
                    del self.net[node]
        self.version += 1
