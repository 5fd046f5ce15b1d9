"""bench/runtime.py's pure parts: the host's speed from the busy-loop probe, and the mean speed
a recorded chunk ran at (what converts it to the time a rank alone would take)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import runtime as bench_runtime  # noqa: E402


def test_host_speed_shares_the_probed_throughput_never_above_a_rank_alone() -> None:
    # two vCPUs that give one busy loop a whole core and two of them 0.55 each
    assert bench_runtime.host_speed({"alone": 1.0, "together": [0.55, 0.55], "ranks": 2}) == pytest.approx([1.0, 0.55])
    # two real cores: both ranks at full speed
    assert bench_runtime.host_speed({"alone": 0.98, "together": [0.97, 0.99], "ranks": 2}) == pytest.approx([1.0, 1.0])
    # eight ranks on that VM: its 1.1 cores shared eight ways
    speed = bench_runtime.host_speed({"alone": 1.0, "together": [0.1375] * 8, "ranks": 8})
    assert speed[0] == 1.0 and speed[1] == pytest.approx(0.55) and speed[7] == pytest.approx(0.1375)


def test_mean_speed_follows_the_other_ranks_busy_intervals() -> None:
    speed = [1.0, 0.5, 1.0 / 3]
    busy = {0: [(0.0, 4.0)], 1: [(1.0, 2.0)], 2: [(1.5, 3.0)]}
    # rank 0 over [0, 4): alone 0-1 (1.0), with rank 1 1-1.5 (0.5), with 1 and 2 1.5-2 (1/3),
    # with rank 2 2-3 (0.5), alone 3-4 (1.0)
    want = (1.0 + 0.5 * 0.5 + 0.5 / 3 + 0.5 + 1.0) / 4.0
    assert bench_runtime.mean_speed(0, 0.0, 4.0, busy, speed) == pytest.approx(want)
    assert bench_runtime.mean_speed(1, 1.0, 2.0, busy, speed) == pytest.approx((0.5 * 0.5 + 0.5 / 3) / 1.0)
    assert bench_runtime.mean_speed(0, 2.0, 2.0, busy, speed) == 1.0  # an empty chunk
