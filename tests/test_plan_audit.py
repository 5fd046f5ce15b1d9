"""The coordinator audits its own re-plans: a switch that measures slower than the plan it
replaced is undone, and that fault keeps the layout until it is over.

Pure logic (coordinator/planner/audit.py) and the coordinator's core with its real state
machine, journal and event log; the engine's planner is replaced by a fixed answer so the
test controls which switch is made (the real planner's choice is tested elsewhere)."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import read_jsonl

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import IterationRecord
from resihp.coordinator.planner.audit import WARMUP, WINDOW, PlanAudit
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.config import ConfigError, CoordinatorConfig
from resihp.coordinator.service.core import CoordinatorCore
from resihp.coordinator.service.engine import EngineDecision, build_header, make_engine
from resihp.coordinator.service.journal import Journal
from resihp.coordinator.service.metrics import Registry
from resihp.coordinator.service.statemachine import State


# --- the pure audit --------------------------------------------------------------------------
def _feed(audit: PlanAudit, epoch: int, first: int, times: list[float]) -> Any:
    verdict = None
    for i, t in enumerate(times):
        verdict = audit.observe(epoch, first + i, t) or verdict
    return verdict


def test_a_new_plan_slower_than_the_old_one_since_the_finding_is_a_regret() -> None:
    audit = PlanAudit(old_epoch=1, new_epoch=2, since_iteration=10, margin=0.2)
    assert _feed(audit, 1, 0, [0.1] * 10) is None  # before the finding: healthy, not the comparison
    assert _feed(audit, 1, 10, [0.3, 0.31, 0.29]) is None  # the old plan with the fault
    # warm-up iterations of the new plan are not judged, whatever they take
    assert _feed(audit, 2, 13, [5.0] * WARMUP + [0.6] * (WINDOW - 1)) is None
    v = audit.observe(2, 13 + WARMUP + WINDOW - 1, 0.6)
    assert v is not None and v.regret
    assert (v.before_s, v.after_s, v.samples) == (0.3, 0.6, (3, WINDOW))
    assert math.isclose(v.ratio, 2.0)
    assert v.describe() == ("epoch 2 runs 0.600 s/iteration against 0.300 s of epoch 1 since the finding "
                            "(100% slower; medians of 5 and 3 iterations)")


def test_a_faster_new_plan_or_one_within_the_margin_is_kept() -> None:
    for after, regret in ((0.2, False), (0.35, False), (0.37, True)):
        audit = PlanAudit(1, 2, 0, margin=0.2)
        _feed(audit, 1, 0, [0.3] * 4)
        v = _feed(audit, 2, 4, [after] * (WARMUP + WINDOW))
        assert v is not None and v.regret is regret, (after, v)


def test_unusable_times_are_ignored_and_a_bad_margin_is_refused() -> None:
    audit = PlanAudit(1, 2, 0, margin=0.1)
    for bad in (math.nan, -1.0, 0.0, math.inf):
        assert audit.observe(1, 0, bad) is None and audit.observe(2, 1, bad) is None
    assert audit.before == [] and audit.after == []
    with pytest.raises(ValueError, match="audit margin must be a finite number >= 0, got -0.5"):
        PlanAudit(1, 2, 0, margin=-0.5)
    with pytest.raises(ConfigError, match="audit_margin must be a number >= 0"):
        CoordinatorConfig(world_size=4, pp=2, audit_margin=math.nan)


def test_an_old_plan_that_ran_too_briefly_after_the_finding_cannot_be_judged() -> None:
    audit = PlanAudit(1, 2, since_iteration=10, margin=0.2)
    _feed(audit, 1, 8, [0.3] * 3)  # only iteration 10 is after the finding
    assert not audit.unjudgeable
    assert _feed(audit, 2, 11, [0.9] * (WARMUP + WINDOW)) is None
    assert audit.unjudgeable


# --- the coordinator -------------------------------------------------------------------------
START = Plan.uniform(1, 2, 2, 8, 4)  # PP2 x DP2, ranks 0-3
SLOW = 3
WITHOUT_3 = Plan(replicas=(PipelinePlan(((0,), (1,)), (4, 4), 3), PipelinePlan(((2,),), (8,), 1)), spares=(SLOW,))


def _core(tmp_path: Path, **policy: str) -> tuple[CoordinatorCore, Any, list[float]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = CoordinatorConfig(world_size=4, pp=2, run_dir=str(tmp_path), apply_lead_s=0.01, heartbeat_timeout_s=1e6,
                            policy=dict(policy))
    engine = make_engine("auto", build_header(preset("gpt-tiny"), START, 4, "job"))
    t = [1000.0]
    core = CoordinatorCore(cfg, START, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           Registry(), lambda: t[0])
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    # the detector's judgement is not under test here: the records only carry iteration times
    core.engine.observe = lambda rec, now: []  # type: ignore[method-assign]
    core.engine.decide = lambda plan, finding, unavailable, now, nodes: (  # type: ignore[method-assign]
        EngineDecision(True, WITHOUT_3, f"planner: leave rank {SLOW} idle", "full-replan"))
    return core, conn, t


def _records(core: CoordinatorCore, epoch: int, first: int, times: list[float]) -> int:
    for i, t in enumerate(times):
        core.joiner.epoch_of[first + i] = epoch
        core._on_record(IterationRecord(first + i, 0.0, t, ()), core.now())
    return first + len(times)


def _ack_all(core: CoordinatorCore, conn: Any) -> m.ReconfigCommand:
    cmd = conn.outbox.get_nowait().commands[0]
    core.on_batch(conn, m.AgentBatch(acks=tuple(m.Ack(r, cmd.seq, cmd.epoch, cmd.apply_at) for r in range(4))))
    assert core.state is State.RUNNING, core.state_reason
    return cmd


def _slow(it: int) -> m.FindingInfo:
    return m.FindingInfo(it, "fail-slow", (SLOW,), "compute", 2.0, f"rank {SLOW} is 2x slow")


def _slow_rank_switched_out(core: CoordinatorCore, conn: Any) -> int:
    """Healthy iterations at 0.2 s, rank 3 found slow, the old plan at 0.4 s until the planner's
    switch (rank 3 left idle) is acknowledged; the next iteration."""
    it = _records(core, 0, 0, [0.2] * 5)
    core._findings([_slow(it)], core.now())
    it = _records(core, 0, it, [0.4] * 3)
    _ack_all(core, conn)
    return it


def _events(core: CoordinatorCore, kind: str) -> list[dict[str, Any]]:
    return [e for e in core.events.since(0, 1000) if e["event"] == kind]


def test_a_replan_that_measures_slower_is_undone_and_the_fault_keeps_the_layout(tmp_path: Path) -> None:
    core, conn, _ = _core(tmp_path)
    it = _records(core, 0, 0, [0.2] * 10)
    core._findings([_slow(it)], core.now())
    it = _records(core, 0, it, [0.4] * 3)  # the old plan, slow rank and all, until the switch
    first = _ack_all(core, conn)
    assert first.plan.spares == (SLOW,) and core.plan.epoch == 1
    it = _records(core, 1, it, [0.9] * (WARMUP + WINDOW))  # the model was wrong: 2.25x slower

    audit, = _events(core, "plan-audit")
    assert (audit["old_epoch"], audit["new_epoch"], audit["before_s"], audit["after_s"], audit["ratio"],
            audit["regret"], audit["outcome"]) == (0, 1, 0.4, 0.9, 2.25, True, "undone")
    back = _ack_all(core, conn)
    assert back.plan.replicas == START.replicas and back.plan.spares == () and back.epoch == 2
    assert back.reason.startswith(f"regret: the re-plan for the fail-slow of ranks [{SLOW}] measured slower: epoch 1 "
                                  f"runs 0.900 s/iteration against 0.400 s of epoch 0"), back.reason
    states = [(e["trigger"], e["to"]) for e in _events(core, "state")]
    assert ("regret", "PLANNING") in states and states[-2:] == [("command-sent", "RECONFIGURING"), ("acked", "RUNNING")]
    assert 'resihp_plan_regrets_total{job="job"} 1' in core.metrics.render()
    kept = {r["rank"]: r["kept"] for r in core.admin.status()["ranks"]}
    assert kept[0] == kept[1] == kept[2] == "" and kept[SLOW].startswith(
        f"a fail-slow keeps the layout: the re-plan for the fail-slow of ranks [{SLOW}] measured slower"), kept

    # the same fault found again: the layout is kept, with the reason; no command
    it = _records(core, 2, it, [0.4] * 5)
    core._findings([_slow(it)], core.now())
    assert conn.outbox.empty() and core.state is State.RUNNING
    assert core.state_reason.startswith(f"keeping the layout for the fail-slow of ranks [{SLOW}]: the re-plan for the "
                                        f"fail-slow of ranks [{SLOW}] measured slower"), core.state_reason
    # its DP partner found slow by the same link: the planner's answer is the very switch that
    # measured slower, so it is refused too
    core._findings([m.FindingInfo(it + 1, "fail-slow", (1,), "communication", 4.0, "rank 1 link")], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith(
        "keeping the layout: the planner's answer is the switch that measured slower: the re-plan for the fail-slow "
        f"of ranks [{SLOW}]"), core.state_reason
    # once it recovers, a new fault on it is planned for again, but the switch that measured
    # slower (with the slow rank in the old layout) is not made again: not for the recovery,
    # not for the next fault
    core._findings([m.FindingInfo(it, "recovered", (SLOW,), reason="recovered")], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith(
        "keeping the layout: the planner's answer is the switch that measured slower"), core.state_reason
    kept = {r["rank"]: r["kept"] for r in core.admin.status()["ranks"]}
    assert kept[SLOW].startswith("the switch that measured slower is not made again: the re-plan for the fail-slow"), kept
    core._findings([_slow(it + 5)], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith("keeping the layout: the planner's answer is the switch")
    # the same grouping with another layer split is refused too; another grouping is not
    resplit = replace(WITHOUT_3, replicas=(PipelinePlan(((0,), (1,)), (5, 3), 3), WITHOUT_3.replicas[1]))
    core.engine.decide = lambda *a: EngineDecision(True, resplit, "planner: 5-3")  # type: ignore[method-assign]
    core._findings([_slow(it + 7)], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith(
        "keeping the layout: the planner's answer regroups the ranks as the switch that measured slower did"), \
        core.state_reason
    core.engine.decide = lambda *a: EngineDecision(False, core.plan, "nothing to gain")  # type: ignore[method-assign]
    core._findings([_slow(it + 9)], core.now())
    assert core.state_reason == "nothing to gain"
    # a restarted coordinator still refuses it (journalled as kind 'switch')
    from resihp.coordinator.service.journal import Journal as J

    assert [r["kind"] for r in J(tmp_path / "journal.jsonl").load().regrets.values()] == ["switch"]


def test_a_replan_that_pays_off_is_kept_and_audits_can_be_switched_off(tmp_path: Path) -> None:
    core, conn, _ = _core(tmp_path)
    it = _slow_rank_switched_out(core, conn)
    _records(core, 1, it, [0.25] * (WARMUP + WINDOW))
    audit, = _events(core, "plan-audit")
    assert (audit["ratio"], audit["regret"], audit["outcome"]) == (0.625, False, "kept")
    assert conn.outbox.empty() and core.plan.epoch == 1

    off, conn2, _ = _core(tmp_path / "off", plan_audit="off")
    it = _slow_rank_switched_out(off, conn2)
    _records(off, 1, it, [0.9] * (WARMUP + WINDOW))
    assert _events(off, "plan-audit") == [] and conn2.outbox.empty() and off.plan.epoch == 1


def test_the_audit_policy_is_validated_and_set_at_run_time(tmp_path: Path) -> None:
    core, _, _ = _core(tmp_path, audit_margin="0.5")
    assert core.policy["audit_margin"] == "0.5" and core.policy["plan_audit"] == "on"
    from resihp.coordinator.protocol.codec import ValidationError

    with pytest.raises(ValidationError, match="policy plan_audit must be 'on' or 'off', got 'maybe'"):
        core.admin.set_policy({"plan_audit": "maybe"})
    with pytest.raises(ValidationError, match="audit_margin"):
        core.admin.set_policy({"audit_margin": "-1"})
    assert core.admin.set_policy({"audit_margin": "0.3"})["audit_margin"] == "0.3"


def test_a_restarted_coordinator_keeps_the_verdict_and_an_operator_clears_it(tmp_path: Path) -> None:
    core, conn, _ = _core(tmp_path)
    it = _slow_rank_switched_out(core, conn)
    it = _records(core, 1, it, [0.9] * (WARMUP + WINDOW))
    _ack_all(core, conn)  # the regret's command back to the old layout
    core.journal.close()

    again, conn2, _ = _core(tmp_path)  # the same run directory: the journal is replayed
    assert again.resumed and again.epoch == 2
    again._findings([_slow(it + 3)], again.now())
    assert conn2.outbox.empty() and again.state_reason.startswith("keeping the layout for the fail-slow of ranks [3]")
    # the operator takes rank 3 out: their call; the verdict is gone, journaled so
    again.admin.exclude(SLOW, "bad NIC")
    _ack_all(again, conn2)
    entries = [e for e in read_jsonl(tmp_path / "journal.jsonl") if e["type"] in ("regret", "regret-over")]
    assert [e["type"] for e in entries] == ["regret", "regret-over"] and entries[1]["id"] == entries[0]["regret"]["id"]
    assert entries[0]["regret"]["ranks"] == [SLOW] and entries[0]["regret"]["after"]["spares"] == [SLOW]
    assert again.audits.kept(_slow(it + 9)) == ""
    again.admin.readmit(SLOW, "NIC replaced")
    _ack_all(again, conn2)
    assert again.audits.current is None  # an operator's switch is theirs: not audited


def test_a_slowdown_that_moved_since_the_regret_is_planned_for_again_but_not_with_the_same_switch(
        tmp_path: Path) -> None:
    core, conn, _ = _core(tmp_path)
    it = _slow_rank_switched_out(core, conn)
    it = _records(core, 1, it, [0.9] * (WARMUP + WINDOW))  # the switch measured slower: undone
    _ack_all(core, conn)
    (regret,) = core.audits.regrets.values()
    assert regret.kind == "fail-slow" and regret.factor == 2.0
    # the detector reports rank 3 again, a little slower (2.4x: under MOVED): the layout is kept
    core._findings([m.FindingInfo(it, "fail-slow", (SLOW,), "compute", 2.4, "rank 3 moved 2.0x -> 2.4x")], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith("keeping the layout for the fail-slow of ranks [3]")
    # ... then at 4x: another trade-off. The planner is asked again; its answer is the very
    # switch that measured slower, which stays refused
    moved = m.FindingInfo(it + 8, "fail-slow", (SLOW,), "compute", 4.0, "rank 3 moved 2.0x -> 4.0x")
    core._findings([moved], core.now())
    assert conn.outbox.empty() and core.state_reason.startswith(
        "keeping the layout: the planner's answer is the switch that measured slower"), core.state_reason
    assert [r.kind for r in core.audits.regrets.values()] == ["switch"]
    # another answer is commanded
    other = Plan(replicas=(PipelinePlan(((0,), (1,)), (4, 4), 3), PipelinePlan(((2,), (3,)), (5, 3), 1)))
    core.engine.decide = lambda *a: EngineDecision(True, other, "planner: less work for rank 3")  # type: ignore[method-assign]
    core._findings([replace(moved, iteration=it + 9)], core.now())
    cmd = _ack_all(core, conn)
    assert cmd.plan.replicas == other.replicas and cmd.reason.startswith("planner: less work for rank 3")
    # a restarted coordinator reads the factor back (and journals of before it, none: 0)
    assert [e["regret"]["factor"] for e in read_jsonl(tmp_path / "journal.jsonl") if e["type"] == "regret"][0] == 2.0
    from resihp.coordinator.service.audit import Regret

    old = regret.to_json()
    del old["factor"]
    assert Regret.from_json(old).factor == 0.0 and not Regret.from_json(old).moved(moved)
