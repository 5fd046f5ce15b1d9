"""bench/runtime.py's pure parts (bench/runtime_analysis.py): the host's speed from the
busy-loop probe, the mean speed a recorded chunk ran at (what converts it to the time a rank
alone would take), and the interval of the hook-overhead ratio."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import runtime_analysis  # noqa: E402


def test_host_speed_shares_the_probed_throughput_never_above_a_rank_alone() -> None:
    # two vCPUs that give one busy loop a whole core and two of them 0.55 each
    assert runtime_analysis.host_speed({"alone": 1.0, "together": [0.55, 0.55], "ranks": 2}) == pytest.approx([1.0, 0.55])
    # two real cores: both ranks at full speed
    assert runtime_analysis.host_speed({"alone": 0.98, "together": [0.97, 0.99], "ranks": 2}) == pytest.approx([1.0, 1.0])
    # eight ranks on that VM: its 1.1 cores shared eight ways
    speed = runtime_analysis.host_speed({"alone": 1.0, "together": [0.1375] * 8, "ranks": 8})
    assert speed[0] == 1.0 and speed[1] == pytest.approx(0.55) and speed[7] == pytest.approx(0.1375)


def test_mean_speed_follows_the_other_ranks_busy_intervals() -> None:
    speed = [1.0, 0.5, 1.0 / 3]
    busy = {0: [(0.0, 4.0)], 1: [(1.0, 2.0)], 2: [(1.5, 3.0)]}
    # rank 0 over [0, 4): alone 0-1 (1.0), with rank 1 1-1.5 (0.5), with 1 and 2 1.5-2 (1/3),
    # with rank 2 2-3 (0.5), alone 3-4 (1.0)
    want = (1.0 + 0.5 * 0.5 + 0.5 / 3 + 0.5 + 1.0) / 4.0
    assert runtime_analysis.mean_speed(0, 0.0, 4.0, busy, speed) == pytest.approx(want)
    assert runtime_analysis.mean_speed(1, 1.0, 2.0, busy, speed) == pytest.approx((0.5 * 0.5 + 0.5 / 3) / 1.0)
    assert runtime_analysis.mean_speed(0, 2.0, 2.0, busy, speed) == 1.0  # an empty chunk


def test_overhead_interval_is_a_point_without_noise_and_widens_with_it() -> None:
    assert runtime_analysis.overhead_interval([0.101] * 6, [0.100] * 6) == pytest.approx((1.01, 1.01))
    with_ = [0.100, 0.104, 0.099, 0.110, 0.101, 0.097]
    without = [0.098, 0.101, 0.103, 0.099, 0.108, 0.100]
    lo, hi = runtime_analysis.overhead_interval(with_, without)
    point = 0.1005 / 0.1005  # the medians of both lists
    assert lo < point < hi and hi - lo > 0.02  # six noisy blocks cannot resolve 0.5 %
    assert runtime_analysis.overhead_interval(with_, without) == (lo, hi)  # seeded: the same every run
