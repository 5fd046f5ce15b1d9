"""The processor-sharing iteration simulator (coordinator/schedule/shared_host.py)."""
from __future__ import annotations

import random

import pytest

from resihp.coordinator.model.plan import Schedule
from resihp.coordinator.schedule.shared_host import simulate_shared, speed_for
from resihp.coordinator.schedule.simulator import simulate_pipeline

S = Schedule.ONE_F_ONE_B


def table(rng: random.Random, pp: int, m: int) -> list[list[float]]:
    return [[rng.uniform(0.5, 2.0) for _ in range(m)] for _ in range(pp)]


@pytest.mark.parametrize("pp,m", [(1, 1), (1, 4), (2, 3), (3, 8), (4, 4)])
def test_a_host_per_stage_is_the_dedicated_pipeline_simulator(pp: int, m: int) -> None:
    rng = random.Random(pp * 100 + m)
    f, b = table(rng, pp, m), table(rng, pp, m)
    got = simulate_shared(S, [f], [b], host_of=[list(range(pp))], p2p_s=0.01)
    want = simulate_pipeline(S, f, b, pp=pp, p2p_s=0.01)
    assert got.makespan_s == pytest.approx(want.makespan_s, rel=1e-12)
    assert list(got.ends[0][:2 * pp * m]) == pytest.approx(list(want._end[:2 * pp * m]), rel=1e-12)


def test_one_core_shared_by_two_replicas_runs_their_work_one_after_the_other() -> None:
    # speed 0.5 each while both compute: the host's throughput is one rank's
    f = [[[1.0, 1.0]], [[1.0, 1.0, 1.0]]]  # unequal shares: 2 and 3 micro-batches
    b = [[[2.0, 2.0]], [[2.0, 2.0, 2.0]]]
    res = simulate_shared(S, f, b, host_of=[[0], [0]], host_speed=[1.0, 0.5], dp_sync_s=0.1, optimizer_s=0.2)
    assert res.makespan_s == pytest.approx(15.0)  # all 15 s of work, never idle
    assert res.iteration_s == pytest.approx(15.3)
    # the short replica ends at 12 s: its 6 s of work at half speed; the long one runs alone after
    assert max(res.ends[0]) == pytest.approx(12.0)


def test_a_pipeline_bubble_runs_at_full_speed() -> None:
    # PP2, one micro-batch: F0 then F1 then B1 then B0, never two at once: no slowdown
    res = simulate_shared(S, [[[1.0], [1.0]]], [[[2.0], [2.0]]], host_of=[[0, 0]], host_speed=[1.0, 0.5])
    assert res.makespan_s == pytest.approx(6.0)
    # many micro-batches: the host is never idle, so the makespan is all the work
    m = 8
    res = simulate_shared(S, [[[1.0] * m, [1.0] * m]], [[[2.0] * m, [2.0] * m]], host_of=[[0, 0]],
                          host_speed=[1.0, 0.5])
    assert res.makespan_s == pytest.approx(2 * m * 3.0)


def test_a_tp_group_counts_as_its_ranks() -> None:
    # a TP2 stage alone on a 2-rank host runs at the speed of two busy ranks
    res = simulate_shared(S, [[[1.0]]], [[[1.0]]], host_of=[[0]], width=[[2]], host_speed=[1.0, 0.8])
    assert res.makespan_s == pytest.approx(2.0 / 0.8)


def test_speed_past_the_measured_list_shares_the_last_throughput() -> None:
    assert speed_for([1.0, 0.5], 2) == 0.5
    assert speed_for([1.0, 0.5], 4) == pytest.approx(0.25)


@pytest.mark.parametrize("kwargs,match", [
    ({"host_speed": [1.0, 0.0]}, "finite speeds > 0"),
    ({"host_speed": [float("nan")]}, "finite speeds > 0"),
    ({"p2p_s": -1.0}, "p2p_s must be finite and >= 0"),
    ({"host_of": [[0, 1]]}, "one entry per stage"),
])
def test_bad_input_is_refused_with_its_reason(kwargs: dict, match: str) -> None:
    args = {"host_of": [[0]], **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate_shared(S, [[[1.0]]], [[[1.0]]], **args)


def test_only_1f1b_is_modelled() -> None:
    with pytest.raises(ValueError, match="only 1f1b"):
        simulate_shared(Schedule.ZB_H1, [[[1.0]]], [[[1.0]]], host_of=[[0]])
