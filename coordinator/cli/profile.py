"""``resihp profile --trace FILE``: the planner's profile measured from a recorded run.

Replays the trace through the detector, as the coordinator does live, and feeds the
iterations in which it judged every rank of the plan healthy to ``ProfileFitter``
(coordinator/planner/profile.py). Prints the profile, and with ``--out`` writes a cluster
file for ``resihp plan --cluster``: the trace's ranks and nodes, the measured fields, and
the rest from ``--cluster`` (or the defaults). Exit code 2 with a message on a malformed
trace or cluster file, or a trace without a healthy timed iteration.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from resihp.coordinator.cli.detect import _config
from resihp.coordinator.detector.detector import Detector
from resihp.coordinator.model.cluster import Cluster, DeviceState
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.model.trace import TraceError, read_trace
from resihp.coordinator.planner.profile import ProfileFitter, fit_trace


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="resihp profile",
                                 description="Measure the planner's profile (device FLOP/s, link speed, ...) from a trace.")
    ap.add_argument("--trace", required=True, help="trace file (JSON Lines, format 1; see docs/trace-format.md)")
    ap.add_argument("--cluster", help="cluster file whose other fields (memory, intra-node bandwidth, ...) to keep")
    ap.add_argument("--config", help="detector options that judge which iterations are healthy (as for resihp detect)")
    ap.add_argument("--window", type=int, default=64, help="healthy iterations the medians run over (the last ones)")
    ap.add_argument("--out", help="write a cluster file for `resihp plan --cluster` here")
    ap.add_argument("--json", action="store_true", help="print the profile as JSON only")
    return ap


def measure(trace: Path, configured: Cluster | None, config_text: str | None, window: int) -> tuple[dict[str, object], Cluster]:
    """(profile JSON, the cluster priced with it). Raises TraceError / ValueError / SpecError."""
    with trace.open(encoding="utf-8") as fh:
        header, records = read_trace(fh)
        det = Detector(header, _config(config_text))
        base = configured or Cluster(devices=(DeviceState(0, "n0"),))
        fit = ProfileFitter(header.model, header.plan, intra_node_bw_Bps=base.intra_node_bw_Bps,
                            inter_node_bw_Bps=base.inter_node_bw_Bps, inter_node_latency_s=base.inter_node_latency_s,
                            intra_node_latency_s=base.intra_node_latency_s,
                            nodes=header.known_nodes(), window=window)
        healthy = fit_trace(records, det, fit)
    prof = fit.profile()
    if not prof.cluster_fields():
        raise ValueError(f"{trace}: no healthy iteration with chunk timings ({healthy} healthy iterations without "
                         "F/B/P2P/DP spans); the profile needs a trace recorded with chunks (docs/trace-format.md)")
    devices = tuple(DeviceState(d.rank, d.node or "n0", memory_bytes=_memory(base, d.rank)) for d in header.devices)
    fields = {k: getattr(base, k) for k in ("intra_node_bw_Bps", "inter_node_bw_Bps", "intra_node_latency_s",
                                            "inter_node_latency_s", "device_flops")}
    cluster = Cluster(devices=devices, **{**fields, **prof.cluster_fields()})
    return {**prof.to_json(), "healthy_iterations_seen": healthy, "summary": prof.describe()}, cluster


def _memory(base: Cluster, rank: int) -> int:
    by_rank = base.by_rank()
    return by_rank[rank].memory_bytes if rank in by_rank else base.devices[0].memory_bytes


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.window < 1:
        print(f"resihp profile: error: --window must be >= 1, got {args.window}", file=sys.stderr)
        return 2
    try:
        configured = Cluster.from_dict(json.loads(Path(args.cluster).read_text())) if args.cluster else None
        prof, cluster = measure(Path(args.trace), configured, args.config, args.window)
    except (TraceError, ValueError, SpecError, OSError) as exc:
        print(f"resihp profile: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(cluster.to_dict(), indent=1) + "\n")
    if args.json:
        print(json.dumps(prof))
    else:
        print(f"planner profile {prof['summary']}")
        if args.out:
            print(f"cluster file for `resihp plan --cluster`: {args.out}")
    return 0
