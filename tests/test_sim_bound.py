"""The upper bound, the resihp adapter's exact memo of planner decisions, and the cached
healthy layout and devices of a job."""
from __future__ import annotations

import pytest

from resihp.coordinator.model.cluster import Cluster, DeviceState
from resihp.coordinator.model.spec import preset
from resihp.coordinator.planner import planner
from resihp.sim.engine import Simulation, loss_breakdown
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies import make
from resihp.sim.policies.base import Settings
from resihp.sim.policies.resihp import _DECISIONS, ResiHP
from resihp.sim.runner import failure_free_tps
from resihp.sim.world import FailSlow, FailStop, Fault

SETTINGS = Settings(checkpoint_interval_s=600.0, checkpoint_stall_s=0.0, restart_s=300.0)
JOB = JobSpec(preset("llama2-7b"), tp=2, pp=1, dp=8, microbatches=32, gpus_per_node=8)


def run(name: str, faults: list[Fault], horizon: float, bound_tps: float | None = None) -> tuple[float, float, float]:
    perf = PerfModel(JOB)
    r0 = failure_free_tps(JOB, perf)
    res = Simulation(make(name, JOB, perf, SETTINGS), JOB.world_size, JOB.gpus_per_node, r0,
                     bound_tps=bound_tps).run(faults, horizon)
    return res.upper_bound_tokens, r0, res.tokens


def test_upper_bound_is_failure_free_rate_times_healthy_compute_over_time() -> None:
    # one of 16 devices down for 1000 s, another at half speed for 2000 s, of 4000 s
    faults: list[Fault] = [FailStop(1000.0, (3,), scope="gpu", repair_s=1000.0), FailSlow(500.0, (9,), 2.0, 2000.0)]
    bound, r0, tokens = run("static", faults, 4000.0)
    lost_device_s = 1000.0 * 1.0 + 2000.0 * 0.5
    assert bound == pytest.approx(r0 * (4000.0 - lost_device_s / 16))
    # a faster healthy layout known to the runner raises the bound, never lowers it
    assert run("static", faults, 4000.0, bound_tps=1.1 * r0)[0] == pytest.approx(1.1 * bound)
    assert run("static", faults, 4000.0, bound_tps=0.5 * r0)[0] == pytest.approx(bound)
    assert tokens <= bound


def test_resihp_memo_is_exact_and_runs_are_deterministic() -> None:
    faults: list[Fault] = [FailSlow(300.0, (5,), 3.0, 2000.0), FailStop(1200.0, (11,), scope="gpu", repair_s=900.0)]
    _DECISIONS.clear()
    perf = PerfModel(JOB)
    r0 = failure_free_tps(JOB, perf)
    first = make("resihp", JOB, perf, SETTINGS)
    res1 = Simulation(first, JOB.world_size, JOB.gpus_per_node, r0).run(faults, 5000.0)
    assert isinstance(first, ResiHP) and first.decisions >= 2 and first.cache_hits == 0
    second = make("resihp", JOB, perf, SETTINGS)
    res2 = Simulation(second, JOB.world_size, JOB.gpus_per_node, r0).run(faults, 5000.0)
    # the same inputs reach the planner again: every decision comes from the memo, and the
    # run is identical (the planner is deterministic, so the memo is exact)
    assert isinstance(second, ResiHP) and second.decisions == 0 and second.cache_hits == first.decisions
    assert res1.tokens == res2.tokens and res1.segments == res2.segments
    assert [line.note for line in res1.log] == [line.note for line in res2.log]
    _DECISIONS.clear()
    third = make("resihp", JOB, perf, SETTINGS)
    res3 = Simulation(third, JOB.world_size, JOB.gpus_per_node, r0).run(faults, 5000.0)
    assert isinstance(third, ResiHP) and third.decisions == first.decisions and res3.segments == res1.segments


def test_job_caches_its_initial_plan_and_devices() -> None:
    assert JOB.initial_plan() is JOB.initial_plan()
    cl = JOB.cluster({3: 0.5}, [7], {9: 2.0})
    fresh = tuple(DeviceState(r, r // 8, 0.5 if r == 3 else 1.0, r == 7, JOB.memory_bytes, 2.0 if r == 9 else 1.0)
                  for r in range(JOB.world_size))
    assert cl.devices == fresh
    assert JOB.cluster().devices == Cluster.uniform(2, 8, memory_bytes=JOB.memory_bytes).devices
    healthy_search = planner.search_plan(JOB.cluster(), JOB.model, JOB.batch(), JOB.initial_plan())
    assert healthy_search.global_microbatches == JOB.microbatches


@pytest.mark.parametrize("name", ["static", "ckpt-restart", "resihp"])
def test_the_loss_breakdown_accounts_for_every_token_below_the_bound(name: str) -> None:
    # the same faults: a lost device (repaired after 1000 s) and a 2x slow one
    faults: list[Fault] = [FailStop(1000.0, (3,), scope="gpu", repair_s=1000.0), FailSlow(500.0, (9,), 2.0, 2000.0)]
    perf = PerfModel(JOB)
    res = Simulation(make(name, JOB, perf, SETTINGS), JOB.world_size, JOB.gpus_per_node,
                     failure_free_tps(JOB, perf)).run(faults, 4000.0)
    parts = loss_breakdown(res)
    assert sum(parts.values()) == pytest.approx(1.0 - res.vs_upper_bound, abs=1e-9)
    assert res.bound_segments[0][0] == 0.0 and res.bound_segments[-1][1] == 4000.0
    assert sum(r * (b - a) for a, b, r in res.bound_segments) == pytest.approx(res.upper_bound_tokens)
    if name == "static":  # stopped until the repair, then relaunched from the last checkpoint
        assert parts["down"] > 0.2 and parts["rolled back"] > 0.0
    if name == "resihp":  # the re-plans' pauses and the slowed plans between them; no rollback
        assert parts["reconfig"] > 0.0 and parts["degraded"] > parts["reconfig"] and "rolled back" not in parts
