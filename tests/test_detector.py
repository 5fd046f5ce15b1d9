"""The detector: states, workload awareness, localisation, fail-stop, configuration."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Hashable
from typing import Any

import pytest

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import ExitEvent, HeartbeatEvent, IterationRecord, PlanChange, Record
from resihp.sim.detect_baselines import ThresholdBaseline
from resihp.sim.workload import Fault, Hardware, Noise, WorkloadConfig, make_header, records_list

MODEL = preset("llama2-7b")
PLAN = Plan.uniform(2, 2, 2, 32, 8)  # 8 ranks, one node


def _now(rec: Record) -> float:
    """When ``rec`` happened (the generated traces change no plan)."""
    assert not isinstance(rec, PlanChange), rec
    return rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else rec.time_s


def _fields(key: Hashable) -> tuple[Any, ...]:
    assert isinstance(key, tuple), key  # the predictor's cost keys are tuples
    return key


def _cfg(faults: tuple[Fault, ...] = (), iterations: int = 24, plan: Plan = PLAN, **kw: object) -> WorkloadConfig:
    opts: dict[str, object] = {"budget": 8192, "seed": 5, "noise": Noise.quiet(), "heartbeats": False}
    opts.update(kw)
    return WorkloadConfig(MODEL, plan, iterations=iterations, faults=faults, **opts)  # type: ignore[arg-type]


def _replay(cfg: WorkloadConfig, det: Detector | None = None) -> tuple[Detector, list[Finding], list[dict[int, str]]]:
    det = det or Detector(make_header(cfg), DetectorConfig(adaptive=False))
    found: list[Finding] = []
    states: list[dict[int, str]] = []
    for rec in records_list(cfg):
        now = _now(rec)
        found += det.observe(rec, now) + det.tick(now)
        if isinstance(rec, IterationRecord):
            states.append(det.suspects())
    return det, found, states


def test_healthy_run_raises_nothing() -> None:
    _, found, states = _replay(_cfg(noise=Noise()))
    assert found == []
    assert set(states[-1].values()) == {"healthy"}


def test_suspect_then_confirmed_then_recovered() -> None:
    cfg = _cfg((Fault("compute", 5, 12, 1.5, end_iter=17),), iterations=26)
    _, found, states = _replay(cfg)
    assert states[11][5] == "healthy"
    assert states[12][5] == "suspect"  # one slow iteration is not a finding
    assert states[13][5] == "slow"
    slow = [f for f in found if f.kind == "fail-slow"]
    assert len(slow) == 1
    f = slow[0]
    assert (f.iteration, f.ranks, f.stage, f.replica, f.cause) == (13, (5,), 0, 1, "compute")
    assert f.tp_group == (4, 5)
    assert f.factor == pytest.approx(1.5, rel=0.03)
    assert re.search(r"rank 5 .*: compute \(F/B/W ops\) ran 1\.[45]\dx the time the calibrated cost model predicts", f.reason)
    assert f.evidence["compute_ratio"] == pytest.approx(1.5, rel=0.03)
    rec = [f for f in found if f.kind == "recovered"]
    assert len(rec) == 1 and rec[0].ranks == (5,) and rec[0].iteration == 19
    assert states[-1][5] == "healthy"


def test_single_slow_iteration_is_not_a_finding() -> None:
    cfg = _cfg((Fault("compute", 2, 12, 3.0, end_iter=13),))
    _, found, states = _replay(cfg)
    assert found == []
    assert states[12][2] == "suspect" and states[13][2] == "healthy"


def test_expensive_batches_raise_no_finding_but_fool_a_raw_threshold() -> None:
    # whole 8K documents next to micro-batches of many short ones: attention cost (Σl²)
    # swings the iteration time by tens of percent with every device healthy
    docs = tuple([8192] * 40 + [256] * 1200)
    cfg = _cfg(documents=docs, iterations=40, packing="greedy", noise=Noise(checkpoint_every=0, loader_prob=0.0))
    _, found, _ = _replay(cfg)
    assert found == []
    times = [r.time_s for r in records_list(cfg) if isinstance(r, IterationRecord)]
    assert max(times) / min(times) > 1.15
    base = ThresholdBaseline(threshold=0.10)
    assert sum(base.observe(i, t) for i, t in enumerate(times)) >= 1


def test_link_fault_localised_to_the_rank_with_the_slow_nic() -> None:
    plan = Plan.uniform(2, 4, 2, 32, 8)
    cfg = WorkloadConfig(MODEL, plan, budget=8192, seed=3, iterations=22, noise=Noise.quiet(), heartbeats=False,
                         hardware=Hardware(gpus_per_node=2), faults=(Fault("link", 3, 12, 2.0),))
    # small activations over a 2x slow NIC cost well under 1 % of the iteration: judged with no
    # floor here, since this is about where the fault is (the cost test is further down)
    _, found, _ = _replay(cfg, Detector(make_header(cfg), DetectorConfig(adaptive=False, impact_floor=0.0)))
    assert [(f.kind, f.ranks, f.cause, f.stage, f.replica) for f in found] == [
        ("fail-slow", (3,), "communication", 1, 0)
    ]
    assert found[0].factor == pytest.approx(2.0, rel=0.1)


def test_coarse_rank_step_evidence_localises_rank_with_unknown_cause() -> None:
    cfg = _cfg((Fault("compute", 6, 12, 1.4),), evidence="rank_step")
    _, found, _ = _replay(cfg)
    assert [(f.kind, f.ranks, f.cause) for f in found] == [("fail-slow", (6,), "unknown")]


def test_iteration_time_only_gives_a_job_level_finding() -> None:
    cfg = _cfg((Fault("compute", 6, 14, 2.0),), evidence="iteration", iterations=24)
    _, found, _ = _replay(cfg)
    assert len(found) == 1 and found[0].ranks == () and found[0].stage is None
    assert "cannot be localised" in found[0].reason


def test_exit_event_is_an_immediate_fail_stop() -> None:
    cfg = _cfg()
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False))
    out = det.observe(ExitEvent(3, 12.5, -9), now=12.5)
    assert len(out) == 1
    f = out[0]
    assert (f.kind, f.ranks, f.cause, f.stage, f.replica) == ("fail-stop", (3,), "process-exit", 1, 0)
    assert "signal 9" in f.reason
    assert det.observe(ExitEvent(3, 13.0, -9), now=13.0) == []  # reported once
    assert det.suspects()[3] == "dead" and det.rank_speed()[3] == 0.0


def test_heartbeat_timeout_uses_the_injected_clock() -> None:
    cfg = _cfg()
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, heartbeat_timeout_s=10.0))
    assert det.tick(1000.0) == []  # no heartbeats seen yet: nothing to time out
    for r in PLAN.ranks():
        det.observe(HeartbeatEvent(r, 0.0), now=0.0)
    for r in PLAN.ranks():
        if r != 7:
            det.observe(HeartbeatEvent(r, 8.0), now=8.0)
    assert det.tick(10.0) == []
    out = det.tick(10.5)
    assert [(f.kind, f.ranks, f.cause) for f in out] == [("fail-stop", (7,), "heartbeat")]
    assert "10.5 s" in out[0].reason
    assert det.tick(11.0) == []


def test_silent_stop_in_a_generated_trace() -> None:
    """A rank stops without exiting (SIGSTOP, a frozen host): the job makes no progress, its
    peers beat on. It is named within two iterations and a second of its stop, long before
    the heartbeat timeout (30 s), cause no-progress."""
    cfg = _cfg((Fault("stop", 4, 15, exit_event=False),), heartbeats=True)
    recs = records_list(cfg)
    its = [r for r in recs if isinstance(r, IterationRecord)]
    usual = sorted(r.time_s for r in its)[len(its) // 2]
    died = its[-1].start_s + its[-1].time_s + 0.4 * its[-1].time_s  # the generator's stop time
    _, found, _ = _replay(cfg)
    assert [(f.kind, f.ranks, f.cause) for f in found] == [("fail-stop", (4,), "no-progress")]
    assert found[0].time_s - died <= 2 * usual + 1.0
    assert "heartbeats stopped" in found[0].reason and "peers' go on" in found[0].reason


def test_rank_speed_and_plan_change_keep_state() -> None:
    cfg = _cfg((Fault("compute", 1, 12, 2.0),))
    det, found, _ = _replay(cfg)
    assert det.rank_speed()[1] == pytest.approx(0.5, rel=0.05)
    det.set_plan(Plan.uniform(2, 2, 2, 32, 8, ranks=list(range(8))))
    assert det.suspects()[1] == "slow"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"slow_threshold": -0.1}, "slow_threshold must be a relative excess"),
        ({"recover_threshold": 0.2}, "recover_threshold"),
        ({"confirm_iters": 0}, "confirm_iters must be a positive integer"),
        ({"heartbeat_timeout_s": 0.0}, "heartbeat_timeout_s must be > 0"),
    ],
)
def test_config_validation_messages(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DetectorConfig(**kwargs)  # type: ignore[arg-type]


def test_config_from_dict_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['slow'\]"):
        DetectorConfig.from_dict({"slow": 0.1})
    assert DetectorConfig.from_dict({"confirm_iters": 3}).confirm_iters == 3


def test_finding_json_has_the_documented_keys() -> None:
    cfg = _cfg((Fault("compute", 5, 12, 2.0),), iterations=16)
    _, found, _ = _replay(cfg)
    doc = found[0].to_json()
    for key in ("iteration", "kind", "ranks", "stage", "replica", "factor", "reason", "cause", "tp_group", "evidence"):
        assert key in doc
    assert doc["kind"] == "fail-slow" and doc["ranks"] == [5]


def test_observe_rejects_non_records() -> None:
    det = Detector(make_header(_cfg()), DetectorConfig(adaptive=False))
    bad: Record = "iteration"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="not a trace record"):
        det.observe(bad, 0.0)


def test_detection_continues_across_a_plan_change_record() -> None:
    from dataclasses import replace as dc_replace


    cfg = _cfg((Fault("compute", 3, 16, 2.0),), iterations=22)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False))
    found: list[Finding] = []
    for rec in records_list(cfg):
        if isinstance(rec, IterationRecord) and rec.iteration == 12:
            found += det.observe(PlanChange(12, dc_replace(PLAN, epoch=1, reason="test")), rec.start_s)
        now = _now(rec)
        found += det.observe(rec, now)
    assert det.index.plan.epoch == 1
    assert [(f.kind, f.ranks, f.iteration) for f in found] == [("fail-slow", (3,), 17)]


def _shared_cpu_records(cfg: WorkloadConfig, slow_rank: int, from_iter: int, peers_speed: float) -> list[Record]:
    """What a sleeping throttle does on shared cores: from ``from_iter`` every other rank's
    compute runs ``peers_speed``x as long (it got the throttled rank's CPU share)."""
    out: list[Record] = []
    for rec in records_list(cfg):
        if isinstance(rec, IterationRecord) and rec.iteration >= from_iter:
            chunks = tuple(
                dataclasses.replace(c, end_s=c.start_s + (c.end_s - c.start_s) * peers_speed)
                if c.kind in ("F", "B", "W") and c.rank != slow_rank else c
                for c in rec.chunks)
            rec = dataclasses.replace(rec, chunks=chunks)
        out.append(rec)
    return out


@pytest.mark.parametrize("peer_relative,expected", [(False, []), (True, [("fail-slow", (2,), 14)])])
def test_peer_relative_compute_sees_a_throttle_whose_cpu_went_to_its_peers(
        peer_relative: bool, expected: list[tuple[str, tuple[int, ...], int]]) -> None:
    # the throttled rank runs 1.35x its calibrated time, its peers 0.72x: against the model
    # it is under the 40 % threshold; against its peers of the same iteration it is 1.9x
    cfg = _cfg((Fault("compute", 2, 12, 1.35),), iterations=24)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.4, confirm_iters=3, recover_threshold=0.1,
                                                    peer_relative=peer_relative))
    found: list[Finding] = []
    for rec in _shared_cpu_records(cfg, 2, 12, 0.72):
        now = _now(rec)
        found += det.observe(rec, now)
    assert [(f.kind, f.ranks, f.iteration) for f in found] == expected
    if peer_relative:
        assert found[0].factor == pytest.approx(1.35 / 0.72, rel=0.03)


def test_peer_relative_keeps_a_slowdown_common_to_every_rank_unless_told_otherwise() -> None:
    # a common speed-up is the model's error; a common slowdown may be every device's: the
    # peer median is capped at 1, so a job-wide 1.5x is reported as before. On a shared host
    # (peer_common_slowdown) it is co-tenant load, and no finding is made
    faults = tuple(Fault("compute", r, 12, 1.5) for r in range(8))
    cfg = _cfg(faults, iterations=20)
    found = {mode: _replay(cfg, Detector(make_header(cfg), DetectorConfig(adaptive=False, peer_relative=mode != "off",
                                                                          peer_common_slowdown=mode == "common")))[1]
             for mode in ("off", "capped", "common")}
    assert sorted(r for f in found["capped"] for r in f.ranks) == list(range(8))
    assert [(f.kind, f.ranks, f.iteration) for f in found["capped"]] == [(f.kind, f.ranks, f.iteration) for f in found["off"]]
    assert found["common"] == []


def test_peer_common_slowdown_still_finds_the_one_rank_slower_than_its_slowed_peers() -> None:
    # every rank 1.3x (load), rank 6 2.6x: only rank 6 stands out from its peers, by 2x
    faults = tuple(Fault("compute", r, 12, 2.6 if r == 6 else 1.3) for r in range(8))
    cfg = _cfg(faults, iterations=20)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, peer_relative=True, peer_common_slowdown=True))
    _, found, _ = _replay(cfg, det)
    assert [(f.kind, f.ranks, f.iteration) for f in found] == [("fail-slow", (6,), 13)]
    assert found[0].factor == pytest.approx(2.0, rel=0.03)


def test_peer_relative_changes_nothing_on_a_healthy_noisy_run() -> None:
    _, found, states = _replay(_cfg(noise=Noise()), Detector(make_header(_cfg(noise=Noise())),
                                                              DetectorConfig(adaptive=False, peer_relative=True)))
    assert found == [] and set(states[-1].values()) == {"healthy"}


def test_peer_relative_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="peer_relative must be true or false, got 1"):
        DetectorConfig.from_dict({"peer_relative": 1})


def test_engine_policy_switches_peer_relative_by_on_and_off() -> None:
    from resihp.coordinator.service.engine_real import RealEngine
    engine = RealEngine(make_header(_cfg()))
    assert engine.policy()["peer_relative"] == "off" and engine.policy()["link_detection"] == "on"
    assert engine.set_policy({"peer_relative": "on"})["peer_relative"] == "on"
    assert engine.detector.config.peer_relative is True
    with pytest.raises(ValueError, match="policy peer_relative must be 'on' or 'off', got '1'"):
        engine.set_policy({"peer_relative": "1"})
    assert engine.detector.config.peer_relative is True  # a refused update changes nothing
    # link_detection, as policy() shows it, is the same switch as links
    assert engine.set_policy({"link_detection": "off"})["links"] == "off"
    assert engine.detector.config.link_detection is False and engine.policy()["link_detection"] == "off"
    with pytest.raises(ValueError, match="peer_common_slowdown needs peer_relative"):
        engine.set_policy({"peer_relative": "off", "peer_common_slowdown": "on"})
    assert engine.set_policy({"peer_common_slowdown": "on"})["peer_common_slowdown"] == "on"


def _tp_coupled_records(cfg: WorkloadConfig, comm_s: float, with_tp_chunks: bool = True) -> list[Record]:
    """What wall-clock spans of a CPU op that contains its TP all-reduces look like: every
    member of a TP group records the op as long as its slowest member's compute plus
    ``comm_s`` of collectives, and (``with_tp_chunks``) a TP chunk of the time it spent
    inside them: ``comm_s`` for the slowest member, more for the partners that waited."""
    plan = cfg.plan
    out: list[Record] = []
    for rec in records_list(cfg):
        if isinstance(rec, IterationRecord):
            own: dict[tuple[tuple[int, ...], str, int, int], float] = {}
            group_of = {}
            for c in rec.chunks:
                if c.kind in ("F", "B", "W"):
                    pos = plan.position(c.rank)
                    group = plan.replicas[pos.replica].stages[pos.stage]
                    group_of[c.rank] = group
                    key = (group, c.kind, c.microbatch, c.chunk)
                    own[key] = max(own.get(key, 0.0), c.duration_s)
            chunks: list[object] = []
            for c in rec.chunks:
                if c.kind not in ("F", "B", "W"):
                    chunks.append(c)
                    continue
                span = own[(group_of[c.rank], c.kind, c.microbatch, c.chunk)] + comm_s
                end = c.start_s + span
                chunks.append(dataclasses.replace(c, end_s=end))
                if with_tp_chunks:
                    chunks.append(dataclasses.replace(c, kind="TP", start_s=end - (span - c.duration_s), end_s=end))
            rec = dataclasses.replace(rec, chunks=tuple(chunks))  # type: ignore[arg-type]
        out.append(rec)
    return out


def _observe_all(det: Detector, records: list[Record]) -> tuple[list[Finding], list[dict[int, str]]]:
    found: list[Finding] = []
    states: list[dict[int, str]] = []
    for rec in records:
        now = _now(rec)
        found += det.observe(rec, now) + det.tick(now)
        if isinstance(rec, IterationRecord):
            states.append(det.suspects())
    return found, states


@pytest.mark.parametrize("with_tp_chunks,named", [(False, (4, 5)), (True, (5,))])
def test_tp_chunks_name_the_slow_member_whose_partner_waited(with_tp_chunks: bool, named: tuple[int, ...]) -> None:
    # rank 5 computes 1.8x from iteration 12 to 18; its TP partner 4 waits for it inside the
    # all-reduces, so both record ops as long. With the time inside collectives (TP chunks)
    # the finding names rank 5 alone; without, the TP group, as before
    cfg = _cfg((Fault("compute", 5, 12, 1.8, end_iter=18),), iterations=30)
    records = _tp_coupled_records(cfg, comm_s=0.002, with_tp_chunks=with_tp_chunks)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.25, confirm_iters=3, recover_threshold=0.1))
    found, states = _observe_all(det, records)
    slow = [f for f in found if f.kind == "fail-slow"]
    assert [(f.ranks, f.iteration) for f in slow] == [(named, 14)]
    assert slow[0].factor == pytest.approx(1.8, rel=0.05)
    rec = [f for f in found if f.kind == "recovered"]
    assert [f.ranks for f in rec] == [named]  # back once the fault ends: nothing was learnt from it
    if with_tp_chunks:
        assert all(s[4] == "healthy" for s in states)
        assert det.rank_speed()[4] == 1.0


def test_a_tp_member_that_waited_for_a_late_partner_is_not_slow() -> None:
    # From iteration 12 rank 5 reaches every collective late: it waited for a slow neighbour
    # in a pipeline receive, outside its compute spans. Rank 4 was on time and waits for it
    # inside the collectives, so its spans are twice as long, all of it in TP chunks; both
    # members' own compute is healthy. (A CI run of the probe demo named such a stage-0
    # member fail-slow at 1.74x when the slow rank was in stage 1.)
    cfg = _cfg(iterations=30)
    records: list[Record] = []
    for rec in _tp_coupled_records(cfg, comm_s=0.002):
        if isinstance(rec, IterationRecord) and rec.iteration >= 12:
            chunks, wait = [], 0.0
            for c in rec.chunks:  # each op's TP chunk follows it (_tp_coupled_records)
                if c.rank == 4 and c.kind in ("F", "B", "W"):
                    wait = c.duration_s  # the op lasts twice as long ...
                    c = dataclasses.replace(c, end_s=c.end_s + wait)
                elif c.rank == 4 and c.kind == "TP":
                    c = dataclasses.replace(c, end_s=c.end_s + wait)  # ... inside its collectives
                chunks.append(c)
            rec = dataclasses.replace(rec, chunks=tuple(chunks))  # type: ignore[arg-type]
        records.append(rec)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.25, confirm_iters=3, recover_threshold=0.1))
    found, states = _observe_all(det, records)
    assert found == [] and states[-1][4] == "healthy", found


def test_tp_chunks_keep_a_whole_slow_tp_group_in_the_finding() -> None:
    # both members slow (a slow TP link, or two sick devices): no member waits for the other
    faults = (Fault("compute", 4, 12, 1.8), Fault("compute", 5, 12, 1.8))
    cfg = _cfg(faults, iterations=20)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.25, confirm_iters=3, recover_threshold=0.1))
    found, _ = _observe_all(det, _tp_coupled_records(cfg, comm_s=0.002))
    assert [(f.kind, f.ranks, f.iteration) for f in found] == [("fail-slow", (4, 5), 14)]


def test_tp_chunks_leave_a_healthy_noisy_run_clean() -> None:
    cfg = _cfg(noise=Noise(), iterations=30)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False))
    found, states = _observe_all(det, _tp_coupled_records(cfg, comm_s=0.002))
    assert found == [] and set(states[-1].values()) == {"healthy"}


def test_a_tp_partner_that_waited_teaches_the_cost_model_nothing() -> None:
    # with TP chunks the waiting partner is not a suspect, but its spans are as slow as the
    # slow member's: the keys of that TP group must not learn from it (a TP2 x PP2 job, so
    # no other group shares the first stage's keys)
    plan = Plan.uniform(2, 2, 1, 32, 8)
    cfg = _cfg((Fault("compute", 1, 12, 1.8),), iterations=40, plan=plan)
    records = _tp_coupled_records(cfg, comm_s=0.002)
    det = Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.25, confirm_iters=3, recover_threshold=0.1))
    cal = det.predictor.cal
    _observe_all(det, records[:13])
    first_stage = [k for k in cal.keys() if _fields(k)[0] == "compute" and _fields(k)[4] == "first"]
    assert len(first_stage) == 2  # F and B of stage 0
    before = {k: cal.samples(k) for k in cal.keys()}
    found, states = _observe_all(det, records[13:])
    assert [(f.kind, f.ranks) for f in found] == [("fail-slow", (1,))] and states[-1][0] == "healthy"
    assert {k: cal.samples(k) for k in first_stage} == {k: before[k] for k in first_stage}
    assert all(cal.samples(k) > before[k] for k in cal.keys() if _fields(k)[0] == "compute" and _fields(k)[4] == "last")


def test_tp_chunks_are_read_as_time_inside_collectives_not_as_compute() -> None:
    import json

    import numpy as np

    from resihp.coordinator.detector.evidence import PlanIndex, timings_from_record
    from resihp.coordinator.model.trace import read_trace

    header = {"format": 1, "type": "header", "job": "tp", "model": {"name": "m", "num_layers": 2, "hidden": 64,
              "num_heads": 4, "ffn_hidden": 256, "vocab": 256}, "plan": Plan.uniform(2, 1, 1, 2, 1).to_dict(),
              "devices": [{"rank": 0, "node": "n0"}, {"rank": 1, "node": "n0"}], "tokens_per_microbatch": 64}
    it = {"type": "iteration", "iteration": 0, "start_s": 0.0, "time_s": 0.05, "seqlens": [[[64]]], "chunks": [
        [0, "F", 0, 0, 0.0, 0.01], [0, "TP", 0, 0, 0.006, 0.01], [0, "B", 0, 0, 0.01, 0.03],
        [0, "TP", 0, 0, 0.02, 0.03], [1, "F", 0, 0, 0.0, 0.01], [1, "B", 0, 0, 0.01, 0.03]]}
    hdr, recs = read_trace([json.dumps(header), json.dumps(it)])
    rec = list(recs)[0]
    assert isinstance(rec, IterationRecord)
    t = timings_from_record(rec, PlanIndex(hdr.plan))
    assert t.compute is not None and t.tp_wait is not None
    assert t.compute[0, 0, :, 0].tolist()[:2] == pytest.approx([0.01, 0.02]) and np.isnan(t.compute[0, 0, 2, 0])
    assert t.tp_wait[0] == pytest.approx(0.014) and np.isnan(t.tp_wait[1])


def test_a_link_slow_rank_recovers_on_its_links_whatever_its_compute_jitter() -> None:
    # the link is back at 18; from then on the rank's compute runs 6 % over the model (a shared
    # core, a warm device): under slow_threshold (10 % here), so no fault of its own, and the
    # link fault is over — before, recovery also waited for compute within recover_threshold (3 %)
    plan = Plan.uniform(2, 4, 2, 32, 8)
    cfg = WorkloadConfig(MODEL, plan, budget=8192, seed=3, iterations=30, noise=Noise.quiet(), heartbeats=False,
                         hardware=Hardware(gpus_per_node=2),
                         faults=(Fault("link", 3, 12, 2.0, end_iter=18), Fault("compute", 3, 18, 1.06)))
    _, found, states = _replay(cfg, Detector(make_header(cfg), DetectorConfig(adaptive=False, slow_threshold=0.10, impact_floor=0.0)))
    assert [(f.kind, f.ranks, f.cause) for f in found] == [("fail-slow", (3,), "communication"),
                                                            ("recovered", (3,), "communication")]
    assert 18 < found[1].iteration <= 22 and states[-1][3] == "healthy"
