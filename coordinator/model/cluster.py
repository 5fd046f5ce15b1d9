"""The cluster and the global batch as the planner sees them.

A Cluster lists every device (rank, node, normalised speed as the detector estimates it,
whether it has failed, its memory) and the links (intra- and inter-node bandwidth and
latency). A GlobalBatch says how many micro-batches an iteration runs and how many tokens
each holds (optionally the packed document lengths of a typical micro-batch, for the
attention term). Both load from JSON (docs/plan-inputs.md); bad input raises SpecError
with a message saying what to fix. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

from resihp.coordinator.model.spec import SpecError

FORMAT = 1
GiB = 2**30
_RANK = attrgetter("rank")


def _num(data: Mapping[str, Any], key: str, where: str, default: float | None = None, positive: bool = True) -> float:
    if key not in data:
        if default is None:
            raise SpecError(f"{where}: missing field {key!r}")
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{where}: field {key!r} must be a number, got {value!r}")
    if positive and value <= 0:
        raise SpecError(f"{where}: field {key!r} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise SpecError(f"{where}: field {key!r} must be >= 0, got {value!r}")
    return float(value)


def _int(data: Mapping[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    if key not in data:
        if default is None:
            raise SpecError(f"{where}: missing field {key!r}")
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class DeviceState:
    rank: int
    node: int | str
    speed: float = 1.0  # normalised compute speed: 1.0 healthy, 0.5 = runs 2x slower
    failed: bool = False
    memory_bytes: int = 80 * GiB
    # inter-node link slowdown of this device (NIC / network congestion): 1.0 healthy, 2.0 =
    # its point-to-point and DP-ring traffic takes twice as long; its compute is unaffected
    link_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.link_factor >= 1.0 and math.isfinite(self.link_factor)):
            raise SpecError(f"device {self.rank}: link_factor must be a number >= 1, got {self.link_factor}")
        if self.rank < 0:
            raise SpecError(f"device rank must be >= 0, got {self.rank}")
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise SpecError(f"device {self.rank}: speed must be a positive number, got {self.speed}")
        if self.memory_bytes <= 0:
            raise SpecError(f"device {self.rank}: memory_bytes must be > 0, got {self.memory_bytes}")


@dataclass(frozen=True)
class Cluster:
    devices: tuple[DeviceState, ...]
    intra_node_bw_Bps: float = 300e9  # NVLink-class, per direction
    inter_node_bw_Bps: float = 25e9  # 200 Gb/s NIC per GPU
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    device_flops: float = 150e12  # sustained bf16 FLOP/s of one healthy device

    def __post_init__(self) -> None:
        if not self.devices:
            raise SpecError("cluster: no devices listed")
        # one C-level pass over 16K devices; the walk that names the first repeat only on failure
        if len(set(map(_RANK, self.devices))) != len(self.devices):
            seen: set[int] = set()
            for d in self.devices:
                if d.rank in seen:
                    raise SpecError(f"cluster: rank {d.rank} is listed twice")
                seen.add(d.rank)
        for name in ("intra_node_bw_Bps", "inter_node_bw_Bps", "device_flops"):
            if not getattr(self, name) > 0:
                raise SpecError(f"cluster: {name} must be > 0, got {getattr(self, name)}")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) < 0:
                raise SpecError(f"cluster: {name} must be >= 0, got {getattr(self, name)}")

    # --- queries ------------------------------------------------------------------------
    def device(self, rank: int) -> DeviceState:
        for d in self.devices:
            if d.rank == rank:
                return d
        raise SpecError(f"cluster: rank {rank} is not in the cluster")

    def by_rank(self) -> dict[int, DeviceState]:
        return {d.rank: d for d in self.devices}

    def healthy(self) -> tuple[DeviceState, ...]:
        return tuple(d for d in self.devices if not d.failed)

    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(d.rank for d in self.devices if d.failed))

    def nodes(self) -> dict[str, list[DeviceState]]:
        """Devices per node (node ids as strings), in rank order."""
        out: dict[str, list[DeviceState]] = {}
        for d in sorted(self.devices, key=lambda x: x.rank):
            out.setdefault(str(d.node), []).append(d)
        return out

    def total_compute(self, include_failed: bool = False) -> float:
        return sum(d.speed for d in self.devices if include_failed or not d.failed)

    # --- edits (the planner and tests derive clusters from findings) -----------------------
    def with_speeds(self, speeds: Mapping[int, float]) -> Cluster:
        devs = tuple(replace(d, speed=float(speeds[d.rank])) if d.rank in speeds else d for d in self.devices)
        return replace(self, devices=devs)

    def with_links(self, factors: Mapping[int, float]) -> Cluster:
        """Set the inter-node link slowdown factor (>= 1) of the given ranks."""
        devs = tuple(replace(d, link_factor=float(factors[d.rank])) if d.rank in factors else d for d in self.devices)
        return replace(self, devices=devs)

    def with_failed(self, ranks: Iterable[int]) -> Cluster:
        dead = set(ranks)
        unknown = dead - {d.rank for d in self.devices}
        if unknown:
            raise SpecError(f"cluster: failed rank(s) {sorted(unknown)} are not in the cluster")
        devs = tuple(replace(d, failed=True) if d.rank in dead else d for d in self.devices)
        return replace(self, devices=devs)

    @classmethod
    def uniform(
        cls,
        nodes: int,
        devices_per_node: int,
        memory_bytes: int = 80 * GiB,
        **links: float,
    ) -> Cluster:
        devs = tuple(
            DeviceState(rank=n * devices_per_node + i, node=n, memory_bytes=memory_bytes)
            for n in range(nodes)
            for i in range(devices_per_node)
        )
        return cls(devices=devs, **links)

    # --- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "intra_node_bw_Bps": self.intra_node_bw_Bps,
            "inter_node_bw_Bps": self.inter_node_bw_Bps,
            "intra_node_latency_s": self.intra_node_latency_s,
            "inter_node_latency_s": self.inter_node_latency_s,
            "device_flops": self.device_flops,
            "devices": [
                {"rank": d.rank, "node": d.node, "speed": d.speed, "failed": d.failed, "memory_bytes": d.memory_bytes,
                 **({"link_factor": d.link_factor} if d.link_factor != 1.0 else {})}
                for d in self.devices
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Either an explicit ``devices`` list or the shorthand ``nodes`` + ``devices_per_node``
        (with optional ``speeds`` {rank: speed} and ``failed`` [ranks])."""
        where = "cluster"
        if not isinstance(data, Mapping):
            raise SpecError(f"{where} must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise SpecError(f"{where}: unsupported format {fmt!r}; this version reads format {FORMAT}")
        links = {
            "intra_node_bw_Bps": _num(data, "intra_node_bw_Bps", where, 300e9),
            "inter_node_bw_Bps": _num(data, "inter_node_bw_Bps", where, 25e9),
            "intra_node_latency_s": _num(data, "intra_node_latency_s", where, 5e-6, positive=False),
            "inter_node_latency_s": _num(data, "inter_node_latency_s", where, 20e-6, positive=False),
            "device_flops": _num(data, "device_flops", where, 150e12),
        }
        default_mem = int(_num(data, "memory_bytes", where, 80.0 * GiB))
        devices: list[DeviceState] = []
        if "devices" in data:
            raw = data["devices"]
            if not isinstance(raw, list) or not raw:
                raise SpecError(f"{where}: 'devices' must be a non-empty list of objects")
            for i, item in enumerate(raw):
                w = f"{where}: devices[{i}]"
                if not isinstance(item, Mapping):
                    raise SpecError(f"{w} must be an object with rank, node (speed, failed, memory_bytes optional)")
                node = item.get("node")
                if isinstance(node, bool) or not isinstance(node, (int, str)):
                    raise SpecError(f"{w}: field 'node' must be an integer or a string, got {node!r}")
                failed = item.get("failed", False)
                if not isinstance(failed, bool):
                    raise SpecError(f"{w}: field 'failed' must be true or false, got {failed!r}")
                devices.append(
                    DeviceState(
                        rank=_int(item, "rank", w, minimum=0),
                        node=node,
                        speed=_num(item, "speed", w, 1.0),
                        failed=failed,
                        memory_bytes=int(_num(item, "memory_bytes", w, float(default_mem))),
                        link_factor=_num(item, "link_factor", w, 1.0),
                    )
                )
        elif "nodes" in data:
            nodes = _int(data, "nodes", where)
            per = _int(data, "devices_per_node", where)
            speeds = data.get("speeds", {})
            failed_list = data.get("failed", [])
            if not isinstance(speeds, Mapping) or not isinstance(failed_list, list):
                raise SpecError(f"{where}: 'speeds' must be an object {{rank: speed}} and 'failed' a list of ranks")
            try:
                speed_of = {int(k): float(v) for k, v in speeds.items()}
                dead = {int(r) for r in failed_list}
            except (TypeError, ValueError) as exc:
                raise SpecError(f"{where}: 'speeds' keys/values and 'failed' entries must be numbers: {exc}") from None
            world = nodes * per
            bad = sorted(r for r in set(speed_of) | dead if not 0 <= r < world)
            if bad:
                raise SpecError(f"{where}: rank(s) {bad} in 'speeds'/'failed' are outside 0..{world - 1}")
            devices = [
                DeviceState(
                    rank=r, node=r // per, speed=speed_of.get(r, 1.0), failed=r in dead, memory_bytes=default_mem
                )
                for r in range(world)
            ]
        else:
            raise SpecError(f"{where}: give either 'devices' (a list) or 'nodes' and 'devices_per_node'")
        return cls(devices=tuple(devices), **links)


@dataclass(frozen=True)
class GlobalBatch:
    """One iteration's work: ``microbatches`` micro-batches of ``tokens_per_microbatch``
    tokens each. ``seqlens`` are the packed document lengths of a typical micro-batch (they
    set the attention term); empty means one document filling the micro-batch."""

    microbatches: int
    tokens_per_microbatch: int
    seqlens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise SpecError(f"batch: microbatches must be >= 1, got {self.microbatches}")
        if self.tokens_per_microbatch < 1:
            raise SpecError(f"batch: tokens_per_microbatch must be >= 1, got {self.tokens_per_microbatch}")
        if any(s < 1 for s in self.seqlens):
            raise SpecError(f"batch: seqlens must be positive, got {list(self.seqlens)}")
        if self.seqlens and sum(self.seqlens) > self.tokens_per_microbatch:
            raise SpecError(
                f"batch: seqlens sum to {sum(self.seqlens)} tokens, more than tokens_per_microbatch "
                f"({self.tokens_per_microbatch})"
            )

    def typical_seqlens(self) -> tuple[int, ...]:
        return self.seqlens or (self.tokens_per_microbatch,)

    @property
    def documents_per_microbatch(self) -> int:
        """Packed documents in a typical micro-batch: the granularity of a document share
        (1: documents fill micro-batches, shares stay whole micro-batches)."""
        return len(self.typical_seqlens())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"microbatches": self.microbatches, "tokens_per_microbatch": self.tokens_per_microbatch}
        if self.seqlens:
            out["seqlens"] = list(self.seqlens)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GlobalBatch:
        where = "batch"
        if not isinstance(data, Mapping):
            raise SpecError(f"{where} must be a JSON object, got {type(data).__name__}")
        seqlens = data.get("seqlens", [])
        if not isinstance(seqlens, Sequence) or isinstance(seqlens, str) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seqlens
        ):
            raise SpecError(f"{where}: 'seqlens' must be a list of integers")
        return cls(
            microbatches=_int(data, "microbatches", where),
            tokens_per_microbatch=_int(data, "tokens_per_microbatch", where),
            seqlens=tuple(seqlens),
        )
