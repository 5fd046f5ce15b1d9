"""Coordinator pieces without a network: state machine, joiner, journal, metrics, core."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.service.config import ConfigError, CoordinatorConfig, load_config
from resihp.coordinator.service.core import CoordinatorCore, Refused
from resihp.coordinator.service.engine import RuleEngine, build_header, make_engine
from resihp.coordinator.service.joiner import Joiner
from resihp.coordinator.service.journal import Journal
from resihp.coordinator.service.metrics import Registry, describe_standard
from resihp.coordinator.service.records import AgentConn
from resihp.coordinator.service.statemachine import IllegalTransition, State, Trigger, step


def test_state_machine_transitions_and_reasons() -> None:
    t = step(State.RUNNING, Trigger.SUSPECTS, "rank 3 looks slow")
    assert (t.after, t.reason) == (State.SUSPECT, "rank 3 looks slow")
    assert step(State.SUSPECT, Trigger.FINDING, "x").after is State.PLANNING
    assert step(State.PLANNING, Trigger.COMMAND_SENT, "x").after is State.RECONFIGURING
    assert step(State.RECONFIGURING, Trigger.ACKED, "x").after is State.RUNNING
    assert step(State.RECONFIGURING, Trigger.FATAL, "x").after is State.ABORTED
    with pytest.raises(IllegalTransition, match="no transition from ABORTED"):
        step(State.ABORTED, Trigger.FINDING, "x")
    with pytest.raises(IllegalTransition, match="allowed there"):
        step(State.RUNNING, Trigger.ACKED, "x")


def _rep(rank: int, it: int, step_s: float = 0.1, epoch: int = 0) -> m.RankReport:
    return m.RankReport(rank, epoch, it, 100.0 + it, step_s, ((10, 6), (16,)))


def test_joiner_waits_for_live_ranks_tolerates_missing_and_late_ones() -> None:
    plan = Plan.uniform(1, 2, 2, 4, 4)  # ranks 0..3, two micro-batches per replica
    j = Joiner(plan, t0=100.0, grace_s=1.0)
    live = frozenset(range(4))
    assert j.add(_rep(0, 0), 0.0, live) == [] and j.add(_rep(1, 0, 0.3), 0.0, live) == []
    assert j.add(_rep(2, 0), 0.1, live) == []
    [rec] = j.add(_rep(3, 0), 0.1, live)
    assert rec.iteration == 0 and rec.time_s == pytest.approx(0.3) and rec.start_s == pytest.approx(0.0)
    assert rec.seqlens == (((10, 6), (16,)), ((10, 6), (16,))) and set(rec.rank_step_s) == {0, 1, 2, 3}
    # rank 3 silent: emitted after the grace period without it
    for r in (0, 1, 2):
        j.add(_rep(r, 1), 1.0, live)
    assert j.flush(1.5, live) == []
    [rec1] = j.flush(2.1, live)
    assert set(rec1.rank_step_s) == {0, 1, 2}
    j.add(_rep(3, 1), 2.2, live)
    assert j.late == 1
    # a dead rank is not waited for
    for r in (0, 1, 2):
        out = j.add(_rep(r, 2), 3.0, frozenset({0, 1, 2}))
    assert [x.iteration for x in out] == [2]


def test_journal_resumes_epoch_plan_exclusions_and_policy(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.jsonl")
    plan = Plan.uniform(1, 1, 2, 4, 4)
    j.start("job", 123.0)
    j.plan(plan)
    j.command({"seq": 1, "epoch": 1, "kind": "reconfigure", "apply_at": 5, "plan": plan.to_dict()}, await_acks=True)
    j.exclusion(1, True)
    j.policy({"auto_reconfigure": "off"})
    j.iteration(40)
    with open(tmp_path / "journal.jsonl", "a") as fh:
        fh.write('{"type": "plan", "epo')  # a torn last write
    j.close()
    st = Journal(tmp_path / "journal.jsonl").load()
    assert (st.job, st.t0, st.epoch, st.seq, st.pending_seq) == ("job", 123.0, 1, 1, 1)
    assert st.excluded == {1} and st.policy == {"auto_reconfigure": "off"} and st.last_iteration == 40
    assert st.plan == plan


def test_metrics_render_prometheus_text() -> None:
    reg = Registry()
    describe_standard(reg)
    reg.set("resihp_rank_step_duration_seconds", 0.25, {"rank": 3, "node": "n\"0", "job": "j"})
    reg.inc("resihp_findings_total", 1, {"kind": "fail-slow", "job": "j"})
    text = reg.render()
    assert '# TYPE resihp_findings_total counter' in text
    assert 'resihp_rank_step_duration_seconds{job="j",node="n\\"0",rank="3"} 0.25' in text
    assert 'resihp_findings_total{job="j",kind="fail-slow"} 1' in text


def test_config_precedence_and_validation(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("world_size: 4\npp: 2\njob: from-file\nheartbeat_timeout_s: 9\n")
    env = {"RESIHP_COORDINATOR_HEARTBEAT_TIMEOUT_S": "7", "RESIHP_JOB": "from-env"}
    cfg = load_config(str(f), env, {"heartbeat_timeout_s": 5.0})
    assert (cfg.job, cfg.heartbeat_timeout_s, cfg.dp) == ("from-file", 5.0, 2)
    with pytest.raises(ConfigError, match="does not equal world_size 4"):
        CoordinatorConfig(world_size=4, tp=3)
    with pytest.raises(ConfigError, match="unknown fields"):
        f.write_text("wrld: 3\n")
        load_config(str(f), {}, {})


def _command(conn: AgentConn) -> m.ReconfigCommand:
    """The first command of the next batch on ``conn``'s outbox (each test's is a reconfiguration)."""
    batch = conn.outbox.get_nowait()
    assert batch is not None, "the stream was ended"
    cmd = batch.commands[0]
    assert isinstance(cmd, m.ReconfigCommand), cmd
    return cmd


def _core(tmp_path: Path, world: int = 4) -> CoordinatorCore:
    return _clocked_core(tmp_path, Plan.uniform(1, 2, world // 2, 8, world))[0]


def _clocked_core(tmp_path: Path, plan: Plan, model: str = "gpt-tiny", **config: Any
                  ) -> tuple[CoordinatorCore, list[float]]:
    """A core over ``plan`` on a clock the test moves (``t[0]``), a switch applying 0.01 s
    after it is issued."""
    world = max(plan.ranks()) + 1
    cfg = CoordinatorConfig(world_size=world, pp=plan.replicas[0].pp, run_dir=str(tmp_path), apply_lead_s=0.01,
                            **config)
    engine = make_engine("auto", build_header(preset(model), plan, world, "job"))
    t = [1000.0]
    core = CoordinatorCore(cfg, plan, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           Registry(), lambda: t[0])
    return core, t


def _one_agent(core: CoordinatorCore, world: int) -> AgentConn:
    """Every rank registered on one agent (node n0)."""
    return core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True)
                                                            for r in range(world))))[0]


def test_core_fail_stop_plans_commands_and_waits_for_every_live_ack(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, welcome = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    assert welcome.world_size == 4 and welcome.epoch == 0
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    assert core.state is State.RECONFIGURING and core.epoch == 1
    cmd = _command(conn)
    assert isinstance(cmd, m.ReconfigCommand) and not cmd.plan.has_rank(3) and cmd.plan.epoch == 1
    for r in (0, 1):
        core.on_batch(conn, m.AgentBatch(acks=(m.Ack(r, cmd.seq, 1, cmd.apply_at),)))
    assert core.state is State.RECONFIGURING  # rank 2 (alive, now a spare) has not acknowledged yet
    core.on_batch(conn, m.AgentBatch(acks=(m.Ack(2, cmd.seq, 1, cmd.apply_at),)))
    assert core.state is State.RUNNING and core.plan == cmd.plan
    kinds = [e["event"] for e in core.events.since(0, 100)]
    assert kinds.count("finding") == 1 and "decision" in kinds and kinds.count("ack") == 3


def test_core_refuses_bad_admin_requests_with_precise_messages(tmp_path: Path) -> None:
    core = _core(tmp_path)
    with pytest.raises(ValidationError, match="rank 9 is out of range; this job has ranks 0..3"):
        core.admin.exclude(9, "")
    with pytest.raises(ValidationError, match="inject kind must be 'slow' or 'kill'"):
        core.admin.inject("melt", 0, 1.0)
    with pytest.raises(Refused, match="no connected agent hosts rank 1"):
        core.admin.inject("kill", 1, 1.0)
    with pytest.raises(ValidationError, match="unknown policy key 'bogus'"):
        core.admin.set_policy({"bogus": "1"})
    with pytest.raises(ValidationError, match="auto_reconfigure must be 'on' or 'off'"):
        core.admin.set_policy({"auto_reconfigure": "maybe"})
    assert core.admin.set_policy({"auto_reconfigure": "off"})["auto_reconfigure"] == "off"
    with pytest.raises(Refused, match="neither excluded nor dead"):
        core.admin.readmit(0, "")
    assert isinstance(core.engine, RuleEngine) or core.engine.name.startswith("detector")
    assert os.path.exists(tmp_path / "events.jsonl")


def _chunked(rank: int, it: int, epoch: int, plan: Plan) -> m.RankReport:
    """A report with per-micro-batch F/B chunks, shaped like ``plan`` (the detector judges it)."""
    from resihp.coordinator.model.trace import ChunkTiming

    rep = plan.replicas[plan.position(rank).replica]
    seqlens = tuple((64, 64) for _ in range(rep.microbatches))
    chunks = tuple(ChunkTiming(rank, kind, mb, 0, 0.02 * mb, 0.02 * mb + (0.004 if kind == "F" else 0.008))
                   for mb in range(rep.microbatches) for kind in ("F", "B"))
    return m.RankReport(rank, epoch, it, 100.0 + it, 0.1, seqlens, chunks)


def test_records_of_a_recovery_that_resumed_before_apply_at_are_judged_by_the_new_plan(tmp_path: Path) -> None:
    """A fail-stop recovery resumes at the last complete step, before the command's apply_at,
    and its first records can arrive before the last ack: the engine takes the new plan from
    them (it used to judge them by the old plan: an IndexError, the report dropped)."""
    core = _core(tmp_path)
    old = core.plan
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    for it in range(3):
        core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, it, 0, old) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    cmd = _command(conn)
    # another shape (two pipelines of one stage: a re-plan keeps a replica, keep_replicas), so
    # the old plan cannot judge the new plan's records
    assert isinstance(cmd, m.ReconfigCommand) and cmd.plan.pp < old.pp and cmd.plan.dp == 2
    resumed = 3  # the survivors rolled back and resumed here, before apply_at
    assert resumed < cmd.apply_at
    members = cmd.plan.ranks()
    for r in members:
        core.on_batch(conn, m.AgentBatch(acks=(m.Ack(r, cmd.seq, 1, resumed),)))
    waiting = [r for r in (0, 1, 2) if r not in members]
    assert waiting, "a spare's ack is still to come"
    core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, resumed, 1, cmd.plan) for r in members)))
    assert core.metrics.get("resihp_internal_errors_total", {"job": "job", "kind": "report"}) is None
    assert core.state is State.RECONFIGURING and core.engine_epoch == 1
    assert core.pending is not None and core.pending.adopted_at == resumed
    for r in waiting:
        core.on_batch(conn, m.AgentBatch(acks=(m.Ack(r, cmd.seq, 1, resumed),)))
    assert core.state is State.RUNNING and core.plan == cmd.plan and core.engine_epoch == 1
    core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, resumed + 1, 1, cmd.plan) for r in members)))
    assert core.metrics.get("resihp_internal_errors_total", {"job": "job", "kind": "report"}) is None
    assert core.metrics.get("resihp_records_unjudged_total", {"job": "job"}) is None
    # reports still of the old plan after the switch: traced, not judged by the new plan
    core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, resumed + 2, 0, old) for r in (0, 1, 2))))
    assert core.metrics.get("resihp_records_unjudged_total", {"job": "job"}) == 1
    assert core.metrics.get("resihp_internal_errors_total", {"job": "job", "kind": "report"}) is None



def test_a_command_not_acknowledged_in_time_is_adopted_with_the_reason(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(world_size=4, pp=2, run_dir=str(tmp_path), apply_lead_s=0.01, ack_timeout_s=5.0,
                            heartbeat_timeout_s=1000.0)
    plan = Plan.uniform(1, 2, 2, 8, 4)
    engine = make_engine("auto", build_header(preset("gpt-tiny"), plan, 4, "job"))
    t = [1000.0]
    core = CoordinatorCore(cfg, plan, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           Registry(), lambda: t[0])
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    cmd = _command(conn)
    core.on_batch(conn, m.AgentBatch(acks=(m.Ack(0, cmd.seq, 1, cmd.apply_at),)))
    t[0] += 4.0
    core.tick()
    assert core.state is State.RECONFIGURING and core.engine_epoch == 0
    t[0] += 2.0
    core.tick()
    assert core.state is State.RUNNING and core.plan == cmd.plan and core.engine_epoch == 1
    assert "ranks [1, 2] did not acknowledge epoch 1 within 5.0 s" in core.state_reason


def test_a_command_the_job_ended_before_is_dropped_without_a_replan(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    before = core.plan
    assert core.admin.exclude(1, "operator") == "operator excluded rank 1 (operator): epoch 1 commanded (command 1)"
    cmd = _command(conn)
    assert core.state is State.RECONFIGURING
    why = f"{m.JOB_ENDED}at step 70, before the members reached iteration {cmd.apply_at}, where epoch 1 was to apply"
    core.on_batch(conn, m.AgentBatch(acks=(m.Ack(3, cmd.seq, 1, 70, ok=False, error=why),)))
    assert core.state is State.RUNNING and core.plan == before and core.epoch == 1
    assert core.state_reason == f"rank 3 did not apply epoch 1: {why}"
    assert conn.outbox.empty()  # nothing planned again for a job that is over
    # an ordinary refusal still plans again
    assert core.admin.exclude(2, "operator").endswith("epoch 2 commanded (command 2)")
    cmd = _command(conn)
    core.on_batch(conn, m.AgentBatch(acks=(m.Ack(3, cmd.seq, 2, cmd.apply_at, ok=False, error="a bad plan"),)))
    assert "rank 3 could not apply epoch 2: a bad plan" in [e.get("reason") for e in core.events.since(0, 100)]


def test_core_a_dead_spare_still_makes_every_trainer_shrink_with_the_same_layout(tmp_path: Path) -> None:
    # the idle spare's death loses no shard, so the planner keeps the layout; the trainers'
    # MPI world still holds the dead rank, so a fail-stop command with that layout is sent
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    first = _command(conn)
    spares = first.plan.spares
    assert isinstance(first, m.ReconfigCommand) and spares, first.plan
    core.on_batch(conn, m.AgentBatch(acks=tuple(m.Ack(r, first.seq, 1, first.apply_at) for r in range(3))))
    assert core.state is State.RUNNING
    spare = spares[0]
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(spare, 100 + spare, 2.0, -9),)))
    cmd = _command(conn)
    assert isinstance(cmd, m.ReconfigCommand) and cmd.epoch == 2
    assert cmd.plan.replicas == first.plan.replicas and spare not in cmd.plan.spares
    assert cmd.reason.startswith(f"fail-stop of ranks [{spare}]")
    assert cmd.reason.endswith("every trainer shrinks MPI past them and goes on with the same layout")


def test_core_with_replanning_off_still_shrinks_past_a_dead_idle_rank_and_nothing_else(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    first = _command(conn)
    core.on_batch(conn, m.AgentBatch(acks=tuple(m.Ack(r, first.seq, 1, first.apply_at) for r in range(3))))
    core.policy["auto_reconfigure"] = "off"
    spare = first.plan.spares[0]
    member = first.plan.ranks()[0]
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(spare, 100 + spare, 2.0, -9),)))
    cmd = _command(conn)
    assert cmd.plan.replicas == first.plan.replicas and cmd.plan.spares == ()
    assert cmd.reason == (f"fail-stop of ranks [{spare}]; re-planning is off (policy auto_reconfigure=off); every "
                          "trainer shrinks MPI past them and goes on with the same layout")
    core.on_batch(conn, m.AgentBatch(acks=tuple(m.Ack(r, cmd.seq, 2, cmd.apply_at) for r in first.plan.ranks())))
    assert core.state is State.RUNNING
    # a member's death is left to the trainers' own recovery when re-planning is off
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(member, 100 + member, 3.0, -9),)))
    assert conn.outbox.empty() and core.epoch == 2


def _spares_core(tmp_path: Path, metrics: Registry | None = None) -> tuple[CoordinatorCore, Any, Any]:
    """A coordinator with the real engine over ranks 0, 1 (two stages) and spares 2, 3, all
    four registered on one agent: (core, engine, the agent's connection)."""
    from resihp.coordinator.model.plan import PipelinePlan

    plan = Plan(replicas=(PipelinePlan(((0,), (1,)), (4, 4), 4),), spares=(2, 3))
    cfg = CoordinatorConfig(world_size=4, pp=2, run_dir=str(tmp_path), apply_lead_s=0.01)
    engine = make_engine("real", build_header(preset("gpt-tiny"), plan, 4, "job"))
    core = CoordinatorCore(cfg, plan, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           metrics or Registry(), lambda: 1000.0)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    return core, engine, conn


def test_admin_readmit_clears_the_slow_verdict_of_a_spare(tmp_path: Path) -> None:
    from resihp.coordinator.detector.detector import RankState

    core, engine, _ = _spares_core(tmp_path)
    # rank 3 as a fail-slow re-plan leaves it: found 2x slow, then moved out of the plan
    det = engine.detector  # type: ignore[attr-defined]
    det._state[3], det._factor[3], det._cause[3] = RankState.SLOW, 2.0, "compute"
    assert engine.rank_speed()[3] == 0.5 and engine.suspects()[3] == "slow"
    with pytest.raises(Refused, match="neither excluded nor dead"):
        core.admin.readmit(2, "")  # a healthy spare: nothing to readmit
    core.admin.readmit(3, "repaired")
    assert engine.suspects()[3] == "healthy" and engine.rank_speed().get(3, 1.0) == 1.0
    readmits = [e for e in core.events.since(0, 100) if e["event"] == "readmit"]
    assert [(e["rank"], e["reason"]) for e in readmits] == [(3, "repaired")]


def test_probes_of_a_slow_spare_recover_it_and_the_coordinator_replans(tmp_path: Path) -> None:
    from resihp.coordinator.detector.detector import RankState

    metrics = Registry()
    core, engine, conn = _spares_core(tmp_path, metrics)
    # every rank's start-up probe, then rank 3 as a fail-slow re-plan leaves it: 2x slow, idle
    core.on_batch(conn, m.AgentBatch(probes=tuple(m.RankProbe(r, 1.0, 0.010) for r in range(4))))
    det = engine.detector  # type: ignore[attr-defined]
    det._state[3], det._factor[3], det._cause[3] = RankState.SLOW, 2.0, "compute"
    # a bad probe is dropped and counted; nothing changes
    core.on_batch(conn, m.AgentBatch(probes=(m.RankProbe(3, 2.0, float("nan")), m.RankProbe(7, 2.0, 0.01))))
    assert engine.suspects()[3] == "slow"
    assert 'kind="probe"' in metrics.render() and "resihp_requests_invalid_total" in metrics.render()
    core.on_batch(conn, m.AgentBatch(probes=(m.RankProbe(3, 3.0, 0.020),)))  # still slow
    core.on_batch(conn, m.AgentBatch(probes=tuple(m.RankProbe(3, 4.0 + i, 0.0101) for i in range(3))))
    assert engine.suspects()[3] == "healthy" and engine.rank_speed().get(3, 1.0) == 1.0
    findings = [e for e in core.events.since(0, 100) if e["event"] == "finding"]
    assert [(f["kind"], f["ranks"]) for f in findings] == [("recovered", [3])]
    assert "idle rank 3 recovered: its last 3 compute probes ran at x1.01" in findings[0]["reason"]
    decisions = [e for e in core.events.since(0, 100) if e["event"] == "decision"]
    assert len(decisions) == 1 and "ranks [3] recovered" in decisions[0]["reason"], decisions


def test_admin_status_shows_each_ranks_role_and_latest_probe(tmp_path: Path) -> None:
    core, _, conn = _spares_core(tmp_path)
    core.on_batch(conn, m.AgentBatch(probes=(m.RankProbe(0, 1.0, 0.010), m.RankProbe(1, 1.0, 0.010),
                                             m.RankProbe(2, 1.0, 0.030))))
    ranks = {r["rank"]: r for r in core.admin.status()["ranks"]}
    assert [ranks[r]["role"] for r in range(4)] == ["member", "member", "spare", "spare"]
    assert (ranks[0]["probe_ratio"], ranks[2]["probe_ratio"], ranks[3]["probe_ratio"]) == (1.0, 3.0, 0.0)
    plan, cfg = core.plan, core.config
    rule = CoordinatorCore(cfg, plan, RuleEngine(build_header(preset("gpt-tiny"), plan, 4, "job")),
                           Journal(tmp_path / "j2.jsonl"), tmp_path / "e2.jsonl", Registry(), lambda: 1000.0)
    assert {r["probe_ratio"] for r in rule.admin.status()["ranks"]} == {0.0}  # the rule engine reads no probes


def test_the_plan_takes_the_trainers_micro_batch_shares_before_anything_is_commanded(tmp_path: Path) -> None:
    core = _core(tmp_path)  # started without the script's --microbatches: 2 per replica
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    four = ((8,), (8,), (8,), (8,))  # the script runs 8 a step
    core.on_batch(conn, m.AgentBatch(reports=(m.RankReport(1, 0, 0, 100.0, 0.1, four),)))
    assert core.plan.global_microbatches == 4  # one replica heard from: not yet
    core.on_batch(conn, m.AgentBatch(reports=(m.RankReport(3, 0, 0, 100.0, 0.1, four),)))
    assert [r.microbatches for r in core.plan.replicas] == [4, 4] and core.plan.epoch == 0
    assert core.joiner.plan_for(0) == core.plan
    events = core.events.since(0, 100)
    said = [e for e in events if e["event"] == "layout-adopted"]
    assert len(said) == 1 and said[0]["reason"] == (
        "the trainers run TP1xPP2xDP2 mb 4,4 (8 micro-batches a step); this coordinator was started with "
        "TP1xPP2xDP2 mb 2,2: it takes the trainers' shares")
    core.on_batch(conn, m.AgentBatch(reports=tuple(m.RankReport(r, 0, 0, 100.0, 0.1, four) for r in (0, 2))))
    assert core.layout_mismatch == "" and "layout-mismatch" not in {e["event"] for e in core.events.since(0, 100)}
    assert Journal(tmp_path / "journal.jsonl").load().plan == core.plan  # a restarted coordinator keeps it


def test_a_trainer_layout_that_cannot_be_adopted_is_named_once_with_the_fix(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(reports=(_rep(0, 0),)))  # rank 0: 2 micro-batches, as planned
    four = ((8,), (8,), (8,), (8,))
    # rank 1, in rank 0's replica, ran 4: the ranks disagree, so there is no layout to adopt
    core.on_batch(conn, m.AgentBatch(reports=(m.RankReport(1, 0, 0, 100.0, 0.1, four),
                                              m.RankReport(1, 0, 1, 100.1, 0.1, four))))
    said = [e for e in core.events.since(0, 100) if e["event"] == "layout-mismatch"]
    assert len(said) == 1 and said[0]["rank"] == 1  # once, not per report
    assert said[0]["reason"].startswith("rank 1 ran 4 micro-batch(es) in iteration 0, but this coordinator's plan "
                                        "(epoch 0: TP1xPP2xDP2 mb 2,2) gives its replica 2")
    assert "resihp launch --microbatches" in said[0]["reason"] and core.plan.global_microbatches == 4
    assert 'resihp_requests_invalid_total{job="job",kind="layout"} 1' in core.metrics.render()


def test_a_switch_in_progress_is_no_hang_and_the_hang_clock_restarts_when_it_is_acknowledged(tmp_path: Path) -> None:
    """A switch pauses the iterations by design; on a loaded machine a rank's beats can lag
    too. A planned exclude was once declared a no-progress fail-stop that way. The hang rule
    waits while a command is pending and counts from its acknowledgement, and still finds a
    rank of the new plan that goes silent after it."""
    plan = Plan.uniform(1, 2, 4, 32, 8)  # a model that needs several ranks after the loss of one
    core, t = _clocked_core(tmp_path, plan, "llama2-7b", ack_timeout_s=60.0, heartbeat_timeout_s=1000.0)
    conn = _one_agent(core, 8)
    for it in range(4):
        core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, it, 0, plan) for r in range(8))))
        t[0] += 0.2

    def beat(silent: int) -> None:
        ranks = tuple(m.RankHeartbeat(r, t[0]) for r in range(7) if r != silent)
        core.on_batch(conn, m.AgentBatch(heartbeat=m.AgentHeartbeat(t[0], ranks)))

    def hangs() -> list[dict[str, Any]]:
        return [e for e in core.events.since(0, 1000) if e["event"] == "finding" and e.get("cause") == "no-progress"]

    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(7, 107, 1.0, -9),)))
    cmd = _command(conn)
    silent = cmd.plan.ranks()[1]
    assert core.engine.hang_after_s() <= 2.0  # the floor: 2 x 0.2 s iterations is less
    for _ in range(10):  # ten seconds of switching, one rank silent all along
        t[0] += 1.0
        beat(silent)
        core.tick()
    assert hangs() == [] and core.state is State.RECONFIGURING
    for r in range(7):
        core.on_batch(conn, m.AgentBatch(acks=(m.Ack(r, cmd.seq, 1, cmd.apply_at),)))
    assert core.state is State.RUNNING
    t[0] += 0.5
    beat(silent)
    core.tick()
    assert hangs() == []  # the clock started at the acknowledgement
    for _ in range(3):
        t[0] += 1.0
        beat(silent)
        core.tick()
    found = hangs()
    assert [f["ranks"] for f in found] == [[silent]], found


def test_the_end_of_a_degraded_slowdown_asks_for_no_replan(tmp_path: Path) -> None:
    """A `degraded` finding (costs under the impact floor) is logged, not acted on; its
    `recovered` must not start a re-plan either (on a real 8-rank CPU job it did: the re-plan
    moved the job to another layout, whose fresh keys then made findings of their own)."""
    core = _core(tmp_path)
    core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core._findings([m.FindingInfo(40, "degraded", (1,), "communication", 3.8, "ring slow, costs 0.0 %", 1000.0,
                                  stage=1, replica=0)], 1000.0)
    core._findings([m.FindingInfo(50, "recovered", (1,), "communication", 1.0, "back", 1001.0, stage=1, replica=0)],
                   1001.0)
    assert core.state is State.RUNNING and core.epoch == 0
    kinds = [e["event"] for e in core.events.since(0, 100)]
    assert kinds.count("finding") == 2 and "decision" not in kinds and "command" not in kinds
    assert core.degraded_only == set()
    # a slowdown that was acted on: its end is a planning matter again
    core._findings([m.FindingInfo(60, "degraded", (1,), "compute", 1.02, "cheap", 1002.0, stage=1, replica=0)], 1002.0)
    core._findings([m.FindingInfo(61, "fail-slow", (1,), "compute", 2.0, "dear now", 1003.0, stage=1, replica=0)], 1003.0)
    assert core.degraded_only == set()
    assert "decision" in [e["event"] for e in core.events.since(0, 100)]
