"""The compiled schedule program agrees with the schedule simulator, and the dense views."""
from __future__ import annotations

import numpy as np
import pytest

from resihp.coordinator.detector.evidence import PlanIndex, batch_features
from resihp.coordinator.detector.program import compile_schedule
from resihp.coordinator.detector.ratios import floor_ratio, nanmedian, trimmed_ratio
from resihp.coordinator.model.plan import Plan, Schedule
from resihp.coordinator.schedule.simulator import simulate_pipeline


@pytest.mark.parametrize(
    "schedule,pp,v,m",
    [(Schedule.ONE_F_ONE_B, 4, 1, 8), (Schedule.ONE_F_ONE_B, 1, 1, 3), (Schedule.INTERLEAVED, 4, 2, 8),
     (Schedule.ZB_H1, 4, 1, 6)],
)
def test_program_matches_simulator(schedule: Schedule, pp: int, v: int, m: int) -> None:
    rng = np.random.default_rng(pp * 10 + v + m)
    prog = compile_schedule(schedule, pp, v, m)
    n_virtual = pp * v
    split = schedule is Schedule.ZB_H1
    f, b = rng.uniform(1, 2, (n_virtual, m)), rng.uniform(1, 3, (n_virtual, m))
    w = rng.uniform(0.5, 1, (n_virtual, m)) if split else None
    want = simulate_pipeline(schedule, f.tolist(), b.tolist(), None if w is None else w.tolist(),
                             pp=pp, virtual_chunks=v, p2p_s=0.05)
    tables = [f, b, w if w is not None else np.zeros_like(f)]
    dur = np.array([[tables[k][j, mb] for k, j, mb in zip(prog.kind, prog.vstage, prog.microbatch)]])
    # two identical replicas in one batch give the same answer twice
    _, end = prog.evaluate(np.vstack([dur, dur]), 0.05)
    assert end.max(axis=1) == pytest.approx([want.makespan_s] * 2)


def test_plan_index_neighbours_and_keys() -> None:
    plan = Plan.uniform(2, 3, 2, 12, 4)
    nodes = {r: f"n{r // 4}" for r in range(12)}
    ix = PlanIndex(plan, nodes)
    i = ix.pos[3]  # replica 0, stage 1, tp 1
    assert ix.ranks[int(ix.fwd_recv[i])] == 5 and ix.ranks[int(ix.bwd_recv[i])] == 1
    assert bool(ix.cross_fwd[i]) and not bool(ix.cross_bwd[i])  # rank 5 is on the next node
    assert ix.fwd_recv[ix.pos[2]] == ix.pos[4] and ix.fwd_recv[ix.pos[5]] == -1  # the last stage sends nothing on
    assert ix.n_groups == 6 and ix.group_leader[ix.group_of[i]] == ix.pos[2]


def test_batch_features_and_robust_ratios() -> None:
    tok, ssq = batch_features((((3, 4), (5,)), ((2,),)), 2)
    assert tok[0].tolist() == [7.0, 5.0] and ssq[0].tolist() == [25.0, 25.0]
    assert tok[1, 0] == 2.0 and np.isnan(tok[1, 1])
    obs = np.array([[1.0] * 7 + [1.3], [2.0, np.nan, 2.0, 2.0] * 2, [np.nan] * 8])
    pred = np.ones((3, 8))
    r = trimmed_ratio(obs, pred)
    assert r[0] == pytest.approx(1.0, abs=0.01)  # one hiccup hardly counts
    assert r[1] == pytest.approx(2.0, rel=1e-5)  # a uniformly slow rank keeps its full factor
    assert np.isnan(r[2])
    assert nanmedian(np.array([[1.0, np.nan, 3.0], [np.nan] * 3]), axis=1)[0] == 2.0


def test_floor_ratio_reads_the_device_through_scheduler_stretches() -> None:
    """Ranks sharing cores: the scheduler stretches most ops by whatever the rank was
    descheduled for, never shrinks one. The least stretched op reads the device's speed; a
    uniformly slow device shows in full; launch-bound tiny ops and untimed entries do not count."""
    rng = np.random.default_rng(5)
    pred = rng.uniform(2.0, 4.0, (4, 8))
    stretch = np.where(rng.random((4, 8)) < 0.8, 1.0 + rng.exponential(0.4, (4, 8)), 1.0)
    stretch[:, 0] = 1.0  # at least one op ran undisturbed
    obs = pred * stretch
    obs[2] *= 1.3  # a slow device, slow in every op
    obs[3, :] = np.nan
    r = floor_ratio(obs, pred)
    assert r[0] == pytest.approx(1.0) and r[1] == pytest.approx(1.0)
    assert r[2] == pytest.approx(1.3)
    assert np.isnan(r[3])
    assert trimmed_ratio(obs, pred)[0] > 1.1  # the ratio of sums carries the stretches
    tiny = np.array([[0.05, 3.0, 3.0]])
    assert floor_ratio(np.array([[0.01, 3.3, 3.6]]), tiny)[0] == pytest.approx(1.1)  # 0.2x a tiny op: no evidence
    grouped = floor_ratio(np.array([[2.0, 4.0], [3.0, 6.0]]), np.array([[1.0, 2.0]]), np.array([0, 0]))
    assert grouped.tolist() == [2.0, 3.0]  # TP members read their group's prediction
