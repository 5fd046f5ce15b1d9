"""The event-driven engine and the world it simulates: exact integrals on hand-made runs."""
from __future__ import annotations

import pytest

from resihp.coordinator.model.spec import preset
from resihp.sim.engine import Phase, Reaction, Simulation, expand
from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Policy, Settings
from resihp.sim.world import FailSlow, FailStop, World, WorldEvent

JOB = JobSpec(preset("llama2-7b"), tp=1, pp=1, dp=2, microbatches=8, gpus_per_node=1, inter_node_bw_Bps=1e15)


class Scripted(Policy):
    """Runs at 100 tokens/s; a fail-stop costs a 50 s pause and rolls back 1,000 tokens; it
    asks for a timer 10 s after each fault and drops to 40 tokens/s when it fires."""

    name = "scripted"

    def start(self, now: float) -> Reaction:
        return Reaction(100.0, "healthy")

    def on_world(self, ev: WorldEvent, now: float) -> Reaction:
        if isinstance(ev.fault, FailStop) and ev.start:
            return Reaction(100.0, "healthy", (Phase(50.0, 0.0, "down"),), keep_phases=False, lost_tokens=1000.0,
                            timers=((now + 10.0, "slow"),))
        return Reaction(100.0, "healthy")

    def on_timer(self, tag: str, now: float) -> Reaction:
        return Reaction(40.0, "degraded")  # keeps the pause under way


def test_engine_integrates_phases_rollbacks_and_timers_exactly() -> None:
    pol = Scripted(JOB, PerfModel(JOB))
    faults = [FailStop(100.0, (0,), repair_s=1000.0)]
    res = Simulation(pol, JOB.world_size, JOB.gpus_per_node, 100.0).run(faults, 400.0)
    # 0-100 at 100/s, 100-150 down (the timer at 110 keeps the pause), 150-400 at 40/s, minus the rollback
    assert res.tokens == pytest.approx(100 * 100 + 250 * 40 - 1000)
    assert res.down_s == pytest.approx(50.0)
    assert [(s.start_s, s.end_s, s.label) for s in res.segments] == [
        (0.0, 100.0, "healthy"), (100.0, 150.0, "down"), (150.0, 400.0, "degraded")]
    # one of the two GPUs is down from t=100: the bound loses half the rate from then on
    assert res.upper_bound_tokens == pytest.approx(100 * 100 + 300 * 50)
    assert res.goodput == pytest.approx(res.tokens / 40000)


def test_tokens_between_reads_the_segment_log() -> None:
    pol = Scripted(JOB, PerfModel(JOB))
    sim = Simulation(pol, JOB.world_size, JOB.gpus_per_node, 100.0)
    sim.run([FailStop(100.0, (0,))], 200.0)
    assert sim.ctx.tokens_between(50.0, 160.0) == pytest.approx(50 * 100 + 10 * 40)


def test_world_tracks_overlapping_faults() -> None:
    w = World(16, 8)
    slow_a = FailSlow(0.0, (3,), 2.0, 100.0)
    slow_b = FailSlow(0.0, (3,), 4.0, 10.0)
    w.apply(WorldEvent(0.0, slow_a, 0, True))
    w.apply(WorldEvent(0.0, slow_b, 1, True))
    assert w.speed(3) == pytest.approx(0.25)
    w.apply(WorldEvent(10.0, slow_b, 1, False))
    assert w.speed(3) == pytest.approx(0.5)
    net = FailSlow(0.0, (9,), 3.0, 10.0, "communication")
    w.apply(WorldEvent(0.0, net, 2, True))
    assert w.net_factor(1) == 3.0 and w.speed(9) == 1.0
    stop = FailStop(5.0, tuple(range(8, 16)), scope="node")
    w.apply(WorldEvent(5.0, stop, 3, True))
    assert w.dead_ranks() == tuple(range(8, 16))
    assert w.healthy_compute_fraction() == pytest.approx((16 - 8 - 0.5) / 16)
    w.apply(WorldEvent(9.0, stop, 3, False))
    assert w.dead_ranks() == ()
    with pytest.raises(ValueError, match="outside 0..15"):
        w.apply(WorldEvent(1.0, FailStop(1.0, (99,)), 4, True))


def test_expand_keeps_only_events_inside_the_horizon() -> None:
    evs = expand([FailStop(10.0, (0,), repair_s=100.0), FailSlow(50.0, (1,), 2.0, 5.0), FailStop(500.0, (1,))], 80.0)
    assert [(e.time_s, e.start) for e in evs] == [(10.0, True), (50.0, True), (55.0, False)]


def test_horizon_must_be_positive() -> None:
    sim = Simulation(Scripted(JOB, PerfModel(JOB)), 2, 1, 1.0)
    with pytest.raises(ValueError, match="horizon"):
        sim.run([], 0.0)


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="restart_s"):
        Settings(restart_s=-1.0)
