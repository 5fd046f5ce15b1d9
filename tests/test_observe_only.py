"""Observe-only jobs ("first, do no harm"): a loop that keeps its own model is observed, never
reshaped and never aborted; findings and a peer's death reach its trainers as notices."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError, preset
from resihp.coordinator.model.trace import IterationRecord, Record
from resihp.coordinator.planner.cost import PlannerConfig
from resihp.coordinator.planner.decision import check_priced, decide, fmt_s
from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.core import CoordinatorCore, Refused
from resihp.coordinator.service.engine import EngineDecision, RuleEngine, build_header
from resihp.coordinator.service.journal import Journal
from resihp.coordinator.service.metrics import Registry
from resihp.coordinator.service.observe import compact, observe_only_reason
from resihp.coordinator.service.records import RankInfo
from resihp.coordinator.service.statemachine import State
from resihp.trainer_hooks.reporting.notices import (
    PEER_FAILURE_EXIT_CODE,
    NoticeHandler,
    exit_on_peer_failure_default,
)

MODEL = json.dumps({"name": "nanogpt-124m", "num_layers": 12, "hidden": 768})
SLOW = m.FindingInfo(3, "fail-slow", (2,), "compute", 1.31, "rank 2 computed 1.31x its predicted time", 5.0,
                     stage=0, replica=2)


class ScriptedEngine(RuleEngine):
    """The rule engine plus findings scripted per iteration; counts every request to price a plan."""

    def __init__(self, plan: Plan, world: int) -> None:
        super().__init__(build_header(preset("gpt-tiny"), plan, world, "job"))
        self.script: dict[int, m.FindingInfo] = {}
        self.decisions = 0

    def observe(self, record: Record, now: float) -> list[m.FindingInfo]:
        out = super().observe(record, now)
        if isinstance(record, IterationRecord) and record.iteration in self.script:
            out.append(self.script.pop(record.iteration))
        return out

    def decide(self, *args: Any, **kwargs: Any) -> EngineDecision:
        self.decisions += 1
        return super().decide(*args, **kwargs)


def _core(tmp_path: Path, world: int = 4) -> tuple[CoordinatorCore, ScriptedEngine]:
    cfg = CoordinatorConfig(world_size=world, pp=1, run_dir=str(tmp_path), apply_lead_s=0.01)
    plan = Plan.uniform(1, 1, world, 4, world)  # what a DDP loop runs: one share per rank
    engine = ScriptedEngine(plan, world)
    core = CoordinatorCore(cfg, plan, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           Registry(), lambda: 1000.0)
    return core, engine


def _sent(conn: Any) -> list[m.Command]:
    out: list[m.Command] = []
    while not conn.outbox.empty():
        batch = conn.outbox.get_nowait()
        assert batch is not None, "the stream was ended"
        out.extend(batch.commands)
    return out


def _step(core: CoordinatorCore, conn: Any, it: int, ranks: range | tuple[int, ...] = range(4)) -> None:
    core.on_batch(conn, m.AgentBatch(reports=tuple(
        m.RankReport(r, 0, it, 100.0 + it, 0.1, ((64, 64),)) for r in ranks)))


def test_findings_of_an_observe_only_job_become_notices_never_commands_nor_an_abort(tmp_path: Path) -> None:
    core, engine = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(
        m.LocalRank(r, r, 100 + r, reshapes=False, model_json=MODEL) for r in range(4))))
    engine.script[3] = SLOW
    for it in range(6):
        _step(core, conn, it)
    sent = _sent(conn)
    assert [type(c) for c in sent] == [m.NoticeCommand], sent
    [notice] = sent
    assert isinstance(notice, m.NoticeCommand) and notice.kind == "finding" and notice.seq == 1
    assert notice.text == "fail-slow finding: rank 2 compute ×1.31 (rank 2 computed 1.31x its predicted time)"
    assert engine.decisions == 0  # never priced: nothing can print "predicted 0.000 → 0.000"
    assert core.state is State.RUNNING and core.epoch == 0
    decision = [e for e in core.events.since(0, 100) if e["event"] == "decision"]
    assert len(decision) == 1 and decision[0]["act"] is False and decision[0]["level"] == "observe-only"
    assert "predicted" not in decision[0]["reason"]
    assert core.metrics.get("resihp_notices_total", {"kind": "finding", "job": "job"}) == 1
    assert core.metrics.get("resihp_findings_total", {"kind": "fail-slow", "job": "job"}) == 1
    assert core.metrics.get("resihp_observe_only", {"job": "job"}) == 1
    said = [e for e in core.events.since(0, 100) if e["event"] == "observe-only"]
    assert [e["rank"] for e in said] == [0, 1, 2, 3]
    st = core.admin.status()
    assert st["observe_only"].startswith("ranks 0-3 run without live reconfiguration"), st["observe_only"]
    assert st["model"] == "nanogpt-124m (12 layers, hidden 768)"
    with pytest.raises(Refused, match="observe-only job: ranks 0-3 run without live reconfiguration"):
        core.admin.replan("test")
    with pytest.raises(Refused, match="observe-only job"):
        core.admin.exclude(2, "test")
    assert 2 not in core.excluded

    # a rank dies: every rank gets one peer-failure notice with the real signal; still no command
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    [death] = _sent(conn)
    assert isinstance(death, m.NoticeCommand) and death.kind == "peer-failure", death
    assert (death.rank, death.code, death.cause, death.iteration, death.ranks) == (3, -9, "process-exit", 5, ())
    assert death.text == "rank 3 (pid 103) on node n0 was killed by signal 9 (SIGKILL)"
    assert death.time_s == pytest.approx(1000.0) and death.seq == 2
    assert core.state is State.RUNNING and engine.decisions == 0
    assert not [e for e in core.events.since(0, 200) if e["event"] in ("command", "command-refused")]
    # a re-delivered exit is one death, one notice
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.1, -9),)))
    assert _sent(conn) == []


def test_a_command_to_an_observe_only_job_is_refused_by_construction(tmp_path: Path) -> None:
    core, engine = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(
        m.LocalRank(r, r, 100 + r, reshapes=r != 1) for r in range(4))))  # one rank keeps its own model
    assert core.observe_only().startswith("rank 1 runs without live reconfiguration")
    with core.lock:
        core._command(Plan.uniform(1, 1, 2, 4, 4), "a test's plan", "dp-shares", 0.0)
    assert _sent(conn) == [] and core.epoch == 0 and core.pending is None
    refused = [e for e in core.events.since(0, 100) if e["event"] == "command-refused"]
    assert len(refused) == 1 and "not sent: a test's plan" in refused[0]["reason"]


def test_a_job_reshapes_only_when_every_live_rank_said_so(tmp_path: Path) -> None:
    ranks = {r: RankInfo(r) for r in range(6)}
    assert "ranks 0-5 have not said" in observe_only_reason(ranks)
    for r in range(6):
        ranks[r].reshapes = True
    assert observe_only_reason(ranks) == ""
    ranks[4].reshapes, ranks[5].reshapes = None, None
    ranks[5].dead = True  # a rank that died before its hello does not hold the job back
    assert observe_only_reason(ranks).startswith("rank 4 has not said")
    ranks[1].reshapes = False
    assert observe_only_reason(ranks).startswith("rank 1 runs without live reconfiguration")
    assert compact([7, 0, 1, 2, 5, 6, 9]) == "0-2,5-7,9"
    # the same core with reshaping ranks commands a plan after a death (the resilient path is unchanged)
    core, engine = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True)
                                                             for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    assert engine.decisions == 1 and any(isinstance(c, m.ReconfigCommand) for c in _sent(conn))


def test_capability_model_and_notices_survive_the_wire() -> None:
    lr = m.LocalRank(5, 1, 77, reshapes=True, model_json=MODEL)
    assert codec.local_rank_from_pb(codec.local_rank_to_pb(lr), "r") == lr
    reg = m.Registration("n0", "job", (lr, m.LocalRank(6, 2, 78)))
    assert codec.registration_from_pb(codec.registration_to_pb(reg)) == reg
    with pytest.raises(codec.ValidationError, match="model_json must be a JSON object"):
        codec.local_rank_from_pb(codec.local_rank_to_pb(m.LocalRank(1, model_json="[1]")), "r")
    n = m.NoticeCommand(3, "rank 2 was killed by signal 9 (SIGKILL)", seq=7, kind="peer-failure", rank=2,
                        cause="process-exit", code=-9, time_s=1234.5, iteration=41)
    assert codec.command_from_pb(codec.command_to_pb(n)) == n
    assert m.command_kind(n) == "notice"
    bad = codec.command_to_pb(n)
    bad.notice.kind = "order"
    with pytest.raises(codec.ValidationError, match="command.notice.kind"):
        codec.command_from_pb(bad)
    assert m.describe_exit(-9) == "was killed by signal 9 (SIGKILL)"
    assert m.describe_exit(m.EXIT_UNKNOWN).startswith("exited (status unknown")  # never "signal 1000"
    assert m.describe_exit(-1) == "was killed by signal 1 (SIGHUP)" and m.describe_exit(3) == "exited with code 3"


def test_the_hook_prints_a_finding_in_one_line_and_a_peer_failure_as_a_summary_then_exits() -> None:
    out = io.StringIO()
    exits: list[int] = []
    aborts: list[int] = []
    env = {"RESIHP_RESTART_CMD": "resihp launch -n 4 --resume ckpt/ -- python train.py"}
    h = NoticeHandler(0, True, stream=out, exit_fn=exits.append, abort_fn=lambda: aborts.append(1), environ=env)
    h(m.NoticeCommand(0, "fail-slow finding: rank 2 compute ×1.31 (slow)", seq=1))
    assert out.getvalue() == "resihp: fail-slow finding: rank 2 compute ×1.31 (slow)\n" and exits == []
    death = m.NoticeCommand(0, "rank 3 (pid 103) on node n0 was killed by signal 9 (SIGKILL)", seq=2,
                            kind="peer-failure", rank=3, cause="process-exit", code=-9, time_s=1.7e9, iteration=41)
    h(death)
    block = out.getvalue().splitlines()[1:]
    assert block[0] == "resihp: ===== peer failure: rank 3 is gone ====="
    assert block[1] == "resihp: what: rank 3 (pid 103) on node n0 was killed by signal 9 (SIGKILL)"
    assert block[2].startswith("resihp: when: at 2023-11-14 22:13:20.000 UTC, after iteration 41")
    assert "process group is broken" in block[3] and "since the last checkpoint are lost" in block[3]
    assert block[5] == "resihp:   resihp launch -n 4 --resume ckpt/ -- python train.py"
    assert block[-1] == f"resihp: rank 0 exits now with code {PEER_FAILURE_EXIT_CODE} instead of waiting in a collective"
    assert exits == [75] and aborts == [1]
    h(death)  # one block per process, one exit
    assert exits == [75] and len(out.getvalue().splitlines()) == 1 + len(block)
    # a resilient rank (exit off) says so and keeps running
    quiet = io.StringIO()
    keep = NoticeHandler(1, False, stream=quiet, exit_fn=exits.append, abort_fn=lambda: aborts.append(1), environ={})
    keep(death)
    assert exits == [75] and "keeps running" in quiet.getvalue().splitlines()[-1]
    assert "restart the job from its last checkpoint" in quiet.getvalue()
    assert exit_on_peer_failure_default(False, {}) and not exit_on_peer_failure_default(True, {})
    assert not exit_on_peer_failure_default(False, {"RESIHP_EXIT_ON_PEER_FAILURE": "0"})
    assert exit_on_peer_failure_default(True, {"RESIHP_EXIT_ON_PEER_FAILURE": "1"})


def test_a_decision_priced_at_zero_or_non_finite_times_is_refused_not_formatted() -> None:
    for bad in (0.0, -1.0, math.nan, math.inf, 1e-9):
        with pytest.raises(SpecError, match="refusing a decision priced"):
            check_priced(0.25, bad)
    check_priced(0.25, 1e-3)
    assert fmt_s(0.441) == "0.441" and fmt_s(0.000213) == "0.000213"
    # a plan priced on a profile of absurd speeds (what a runtime-less job gave): refused
    spec = preset("gpt-tiny")
    fast = dict(device_flops=1e30, intra_node_bw_Bps=1e30, inter_node_bw_Bps=1e30, inter_node_latency_s=0.0)
    cluster = Cluster(devices=tuple(DeviceState(rank=r, node="n0", speed=1 / 1.3 if r == 2 else 1.0)
                                    for r in range(4)), **fast)  # type: ignore[arg-type]
    finding = SimpleNamespace(kind="fail-slow", ranks=(2,), factor=1.3, cause="compute", time_s=0.0)
    with pytest.raises(SpecError, match=r"refusing a decision priced at .* s/iteration"):
        decide(cluster, spec, GlobalBatch(4, 128), Plan.uniform(1, 1, 4, spec.num_layers, 4), finding, 0.0,
               PlannerConfig(hbm_bw_Bps=1e30))


NANO = {"name": "GPT", "num_layers": 2, "hidden": 64, "num_heads": 4, "ffn_hidden": 256, "vocab": 256}


def test_the_coordinator_prices_the_model_the_trainers_said_they_train(tmp_path: Path) -> None:
    core, engine = _core(tmp_path)
    trace = tmp_path / "trace.jsonl"
    from resihp.coordinator.service.trace_sink import TraceSink
    core.trace = TraceSink(trace, engine.header)
    core.register(m.Registration("n0", "job", tuple(
        m.LocalRank(r, r, 100 + r, reshapes=False, model_json=json.dumps(NANO)) for r in range(4))))
    assert engine.header.model.num_layers == 2 and engine.header.model.hidden == 64
    assert core.plan.replicas[0].layers == (2,) and engine.header.plan.replicas[0].layers == (2,)
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["model"]["num_layers"] == 2 and header["plan"]["replicas"][0]["layers"] == [2]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    adopted = [e for e in events if e["event"] == "model-adopted"]
    assert len(adopted) == 1 and "started with gpt-tiny" in adopted[0]["reason"]


def test_a_model_said_after_iterations_were_judged_is_a_mismatch_not_a_switch(tmp_path: Path) -> None:
    core, engine = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r) for r in range(4))))
    _step(core, conn, 0)
    core.register(m.Registration("n1", "job", (m.LocalRank(0, 0, 200, model_json=json.dumps(NANO)),)))
    assert engine.header.model.name == "gpt-tiny"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    said = [e["reason"] for e in events if e["event"] == "model-mismatch"]
    assert said and "resihp launch --model" in said[0] and "has judged iterations" in said[0]


def test_a_degraded_finding_is_logged_and_counted_but_never_planned_on(tmp_path: Path) -> None:
    core, engine = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True)
                                                               for r in range(4))))
    engine.script[3] = m.FindingInfo(3, "degraded", (2,), "communication", 2.0, "rank 2: costs 0.3 %", 5.0,
                                     stage=0, replica=2, extra={"evidence": {"cost_share": 0.003}})
    for it in range(6):
        _step(core, conn, it)
    assert engine.decisions == 0 and core.state is State.RUNNING
    assert not [c for c in _sent(conn) if not isinstance(c, m.NoticeCommand)]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events if e["event"] == "finding"] == ["degraded"]
    assert core.metrics.render().count('resihp_findings_total{job="job",kind="degraded"} 1') == 1


def test_a_stopped_rank_that_holds_the_job_up_is_named_in_seconds_not_at_the_heartbeat_timeout(
        tmp_path: Path) -> None:
    """SIGSTOP of one rank: no iteration comes, its heartbeats stop while its peers' go on. The
    coordinator names it fail-stop, cause no-progress, once the stall exceeds the hang time
    (2 usual iterations, at least 1 s) and its silence stands out — not after the heartbeat
    timeout (30 s here) — and an observe-only job's trainers get a peer-failure notice."""
    clock = [1000.0]
    cfg = CoordinatorConfig(world_size=4, pp=1, run_dir=str(tmp_path), apply_lead_s=0.01, heartbeat_timeout_s=30.0)
    plan = Plan.uniform(1, 1, 4, 4, 4)
    engine = ScriptedEngine(plan, 4)
    core = CoordinatorCore(cfg, plan, engine, Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl",
                           Registry(), lambda: clock[0])
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=False)
                                                               for r in range(4))))

    def beat(ranks: tuple[int, ...]) -> None:
        core.on_batch(conn, m.AgentBatch(heartbeat=m.AgentHeartbeat(
            clock[0], tuple(m.RankHeartbeat(r, clock[0], 5) for r in ranks))))

    for it in range(6):  # 0.2 s iterations
        clock[0] += 0.2
        core.on_batch(conn, m.AgentBatch(reports=tuple(
            m.RankReport(r, 0, it, clock[0] - 0.2, 0.2, ((64, 64),)) for r in range(4))))
        core.tick()
    stopped_at = clock[0]
    found: list[m.NoticeCommand] = []
    while clock[0] < stopped_at + 10.0:
        clock[0] += 0.5
        beat((0, 1, 3))  # rank 2 is stopped
        core.tick()
        found = [c for c in _sent(conn) if isinstance(c, m.NoticeCommand) and c.kind == "peer-failure"]
        if found:
            break
    assert found and found[0].rank == 2 and found[0].cause == "no-progress"
    assert clock[0] - stopped_at <= 3.0  # hang time 1 s + silence beyond the peers' by 1 s, on 0.5 s ticks
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    stop = [e for e in events if e["event"] == "finding" and e["kind"] == "fail-stop"]
    assert [(s["ranks"], s["cause"]) for s in stop] == [([2], "no-progress")]
    assert "while its peers beat on" in stop[0]["reason"]
