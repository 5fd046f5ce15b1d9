"""Pure pieces of the resilient job: plan descriptions, the runtime's TP constraint in the
planner, command handling at step boundaries, the progress log, the coordinator's trace and
its resistance to a failing handler, the admin CLI's option placement, the launcher's abort
watch. The real multi-rank run is tests/test_demo_e2e.py."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resihp.coordinator.model.cluster import Cluster, DeviceState, GlobalBatch
from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import IterationRecord, PlanChange, Record, load_trace
from resihp.coordinator.planner.cost import PlannerConfig
from resihp.coordinator.planner.decision import decide, tp_uniform_per_layer
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.config import CoordinatorConfig
from resihp.coordinator.service.core import CoordinatorCore, TraceSink
from resihp.coordinator.service.engine import build_header, make_engine
from resihp.coordinator.service.journal import Journal
from resihp.coordinator.service.metrics import Registry


def test_plan_describe_uniform_and_mixed_layouts() -> None:
    assert Plan.uniform(2, 2, 2, 8, 8).describe() == "TP2xPP2xDP2 mb 4,4"
    mixed = Plan((PipelinePlan(((0, 1), (2, 3)), (2, 6), 3), PipelinePlan(((4, 5), (6, 7)), (4, 4), 5)))
    assert mixed.describe() == "[PP2 TP2,2 L2,6 mb3 | PP2 TP2,2 L4,4 mb5]"
    uneven = Plan((PipelinePlan(((0,), (1,)), (5, 3), 8),), spares=(2, 3))
    assert uneven.describe() == "TP1xPP2xDP1 L5,3 mb 8 spares 2,3"


def test_tp_uniform_per_layer_rejects_replicas_that_split_a_layer_differently() -> None:
    same = Plan((PipelinePlan(((0, 1), (2, 3)), (4, 4), 4), PipelinePlan(((4, 5), (6, 7)), (4, 4), 4)))
    assert tp_uniform_per_layer(same)
    tp_mix = Plan((PipelinePlan(((0,),), (8,), 4), PipelinePlan(((4, 5),), (8,), 4)))
    assert not tp_uniform_per_layer(tp_mix)
    # same TP sizes per stage but layers split at different points: layer 3 is TP2 in one
    # replica and TP1 in the other
    split_mix = Plan((PipelinePlan(((0, 1), (2,)), (4, 4), 4), PipelinePlan(((4, 5), (6,)), (2, 6), 4)))
    assert not tp_uniform_per_layer(split_mix)


def test_planner_with_uniform_tp_never_returns_a_plan_the_runtime_cannot_run() -> None:
    spec = preset("gpt-tiny")
    current = Plan.uniform(2, 2, 2, spec.num_layers, 8)
    devices = tuple(DeviceState(rank=r, node="node0", speed=0.45 if r == 2 else 1.0) for r in range(8))
    cluster = Cluster(devices=devices, device_flops=2e9, intra_node_bw_Bps=2e9, inter_node_bw_Bps=2e9,
                      intra_node_latency_s=2e-4, inter_node_latency_s=2e-4)
    batch = GlobalBatch(8, 128)
    finding = SimpleNamespace(kind="fail-slow", ranks=(2, 3), factor=2.2, cause="compute", time_s=0.0, iteration=20)
    d = decide(cluster, spec, batch, current, finding, 0.0, PlannerConfig(uniform_tp_per_layer=True))
    assert all(tp_uniform_per_layer(c.plan) for c in d.candidates)
    assert tp_uniform_per_layer(d.plan)


class _Transport:
    def __init__(self) -> None:
        self.commands: list[m.Command] = []
        self.acks: list[tuple[int, bool, str]] = []

    def probe(self, probe_s: float) -> None:  # compute probes are the agent's business
        return None

    def poll_commands(self) -> list[m.Command]:
        out, self.commands = self.commands, []
        return out

    def ack(self, command: m.Command, iteration: int, ok: bool = True, error: str = "") -> None:
        self.acks.append((command.seq, ok, error))


def _job(plan: Plan, handler: Any) -> Any:
    from resihp.trainer_hooks.hooks import Job
    from resihp.trainer_hooks.runtime.throttle import Throttle

    boot = SimpleNamespace(rank=0, world_size=8, job_start_s=0.0)
    return Job(boot=boot, model=preset("gpt-tiny"), plan=plan, config=None, transport=_Transport(),  # type: ignore[arg-type]
               throttle=Throttle(), on_reconfigure=handler)


def test_commands_apply_at_their_boundary_and_a_deferring_handler_is_not_acknowledged() -> None:
    plan = Plan.uniform(2, 2, 2, 8, 8)
    seen: list[int] = []

    def handler(job: Any, cmd: m.ReconfigCommand) -> bool:
        seen.append(cmd.seq)
        return cmd.seq != 2  # command 2 is deferred (a fail-stop plan, acknowledged by the recovery)

    job = _job(plan, handler)
    tx = job.transport
    tx.commands = [m.ReconfigCommand(1, plan, 5, "planned", 1), m.ReconfigCommand(2, plan, 3, "fail-stop of ranks [5]", 2)]
    assert job._apply_commands(1).applied == ()  # due after step 2 and step 4: nothing yet
    out = job._apply_commands(2)  # command 2 is due before step 3
    assert seen == [2] and tx.acks == [] and out.applied == ()
    out = job._apply_commands(4)
    assert seen == [2, 1] and tx.acks == [(1, True, "")] and out.applied == ("reconfigure",)


def test_a_plan_already_in_force_is_acknowledged_at_once_and_a_failing_one_with_its_reason() -> None:
    plan = Plan.uniform(2, 2, 2, 8, 8)

    def handler(job: Any, cmd: m.ReconfigCommand) -> bool:
        if cmd.seq == 4:
            raise RuntimeError("epoch 9 cannot run here")
        return True

    job = _job(replace_epoch(plan, 3), handler)
    job.transport.commands = [m.ReconfigCommand(3, plan, 100, "fail-stop of ranks [5]", 3),
                              m.ReconfigCommand(9, plan, 0, "bad", 4)]
    job._apply_commands(0)
    assert job.transport.acks == [(3, True, ""), (4, False, "epoch 9 cannot run here")]


def replace_epoch(plan: Plan, epoch: int) -> Plan:
    from dataclasses import replace

    return replace(plan, epoch=epoch)


def test_progress_log_lines_are_json_with_type_and_time(tmp_path: Path) -> None:
    from resihp.trainer_hooks.runtime.progress_log import ProgressLog, loss_rank

    log = ProgressLog(tmp_path / "run" / "progress.jsonl")
    log.write("step", step=3, loss=4.5, tokens=1024, kind="not-the-type")
    log.write("reconfig", kind="fail-stop", epoch=2)
    lines = [json.loads(x) for x in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert [x["type"] for x in lines] == ["step", "reconfig"]
    assert lines[0]["kind"] == "not-the-type" and lines[1]["kind"] == "fail-stop" and lines[0]["time"] > 0
    assert loss_rank(Plan.uniform(2, 2, 2, 8, 8)) == 2  # TP rank 0 of replica 0's last stage


def _core(tmp_path: Path) -> CoordinatorCore:
    cfg = CoordinatorConfig(world_size=4, pp=2, run_dir=str(tmp_path), apply_lead_s=0.01)
    plan = Plan.uniform(1, 2, 2, 8, 4)
    header = build_header(preset("gpt-tiny"), plan, 4, "job")
    core = CoordinatorCore(cfg, plan, make_engine("auto", header), Journal(tmp_path / "journal.jsonl"),
                           tmp_path / "events.jsonl", Registry(), lambda: 1000.0)
    core.trace = TraceSink(tmp_path / "trace.jsonl", header)
    return core


def test_a_failing_handler_drops_its_item_but_not_the_agent_stream(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))

    def broken(*_: Any) -> None:
        raise IndexError("index 1 is out of bounds for axis 0 with size 1")

    core._on_report = broken  # type: ignore[method-assign]
    core.on_batch(conn, m.AgentBatch(reports=(m.RankReport(0, 0, 1, 0.0, 0.1),), exits=(m.RankExit(3, 103, 1.0, -9),)))
    assert core.ranks[3].dead  # the exit after the failing report was still handled
    text = core.metrics.render()
    assert 'resihp_internal_errors_total{job="job",kind="report"} 1' in text


def test_coordinator_trace_marks_the_fail_stop_command_and_records_the_exit(tmp_path: Path) -> None:
    core = _core(tmp_path)
    conn, _ = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, reshapes=True) for r in range(4))))
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))  # fail-stop → a new plan
    header, records = load_trace(str(tmp_path / "trace.jsonl"))
    assert header.model.name == "gpt-tiny" and [type(r).__name__ for r in records] == ["ExitEvent"]
    batch = conn.outbox.get_nowait()
    assert batch is not None
    cmd = batch.commands[0]
    assert isinstance(cmd, m.ReconfigCommand) and cmd.reason.startswith("fail-stop of ranks [3]")


def _iteration(r: Record) -> int:
    assert isinstance(r, (IterationRecord, PlanChange)), r  # the sink's traces hold no events here
    return r.iteration


def test_trace_sink_writes_a_plan_change_just_before_the_first_record_on_the_new_plan(tmp_path: Path) -> None:
    old = Plan.uniform(1, 2, 2, 8, 4)
    new = Plan.uniform(1, 2, 1, 8, 4, )
    header = build_header(preset("gpt-tiny"), old, 4, "job")
    sink = TraceSink(tmp_path / "t.jsonl", header)
    two, one = ((128,), (128,)), ((128,), (128,), (128,), (128,))
    sink.write(PlanChange(5, new))
    sink.write(IterationRecord(4, 0.0, 0.1, (two, two)))  # joined late: still the old plan
    sink.write(IterationRecord(5, 0.1, 0.1, (one,)))
    sink.write(PlanChange(9, old))
    sink.write(IterationRecord(7, 0.2, 0.1, (two, two)))  # a recovery resumed early: shaped like the new plan
    sink.close()
    _, records = load_trace(str(tmp_path / "t.jsonl"))
    got = [(type(r).__name__, _iteration(r)) for r in records]
    assert got == [("IterationRecord", 4), ("PlanChange", 5), ("IterationRecord", 5), ("PlanChange", 7),
                   ("IterationRecord", 7)]


def test_trace_sink_places_a_plan_change_where_the_ranks_switched_by_the_records_epoch(tmp_path: Path) -> None:
    """With each record's plan epoch (the joiner's), a switch that came after its apply_at
    (a late command: same replica count, so no shape tells) and a superseded plan that never
    ran are written as they happened."""
    start = Plan.uniform(2, 1, 2, 8, 4)
    tp4 = replace(Plan.uniform(4, 1, 1, 8, 4), epoch=1)
    unrun, pp2 = replace(Plan.uniform(1, 2, 2, 8, 4), epoch=2), replace(Plan.uniform(2, 2, 1, 8, 4), epoch=3)
    sink = TraceSink(tmp_path / "t.jsonl", build_header(preset("gpt-tiny"), start, 4, "job"))
    mb = (128,)
    two, one = ((mb, mb), (mb, mb)), ((mb,) * 4,)  # seqlens per replica, per micro-batch
    sink.write(PlanChange(5, tp4))
    for it in (5, 6):  # the switch was agreed two boundaries late: still TP2 x DP2
        sink.write(IterationRecord(it, 0.1 * it, 0.1, two), 0)
    sink.write(IterationRecord(7, 0.7, 0.1, one), 1)
    sink.write(PlanChange(10, unrun))
    sink.write(PlanChange(12, pp2))  # a fail-stop superseded epoch 2 before any rank ran it
    sink.write(IterationRecord(9, 0.9, 0.1, one), 3)  # the recovery resumed at 9
    sink.close()
    _, records = load_trace(str(tmp_path / "t.jsonl"))
    got = [(type(r).__name__, _iteration(r), getattr(getattr(r, "plan", None), "epoch", None)) for r in records]
    assert got == [("IterationRecord", 5, None), ("IterationRecord", 6, None), ("PlanChange", 7, 1),
                   ("IterationRecord", 7, None), ("PlanChange", 9, 3), ("IterationRecord", 9, None)]


@pytest.mark.parametrize("argv", [["--run-dir", "D", "status"], ["status", "--run-dir", "D"]])
def test_admin_options_work_before_and_after_the_subcommand(argv: list[str]) -> None:
    from resihp.coordinator.cli.admin import _parser

    args = _parser().parse_args(argv)
    assert args.run_dir == "D" and args.cmd == "status" and args.timeout == 5.0


def test_launch_watch_ends_the_job_on_finish_or_abort(tmp_path: Path) -> None:
    from resihp.trainer_hooks.launch.launcher import _JobFinishedWatch

    ev = tmp_path / "events.jsonl"
    ev.write_text(json.dumps({"event": "state", "to": "RUNNING"}) + "\n")
    w = _JobFinishedWatch(ev)
    assert not w.poll()
    with open(ev, "a") as fh:
        fh.write(json.dumps({"event": "state", "from": "PLANNING", "to": "ABORTED"}, separators=(",", ":")) + "\n")
    assert w.poll() and w.aborted and not w.finished


def _resilience(plan: Plan, transport: Any) -> Any:
    from resihp.trainer_hooks.runtime.resilient import Resilience
    from resihp.trainer_hooks.runtime.trainer import TrainConfig

    rc = SimpleNamespace(epoch=plan.epoch, members=tuple(range(8)), plan=plan, rank=0, timeout_s=1.0, group_timeout_s=1.0,
                         config=TrainConfig(max_seq_len=64))
    job = SimpleNamespace(_pending=[], transport=transport)
    return Resilience(job=job, rc=rc, world=SimpleNamespace(), agreement=object(), plan_wait_s=60.0)  # type: ignore[arg-type]


def test_a_plan_that_changes_the_global_batch_is_refused_in_a_switch_and_in_a_recovery() -> None:
    """A coordinator started with another --microbatches than the script would otherwise halve
    (or double) what each step trains after its first re-plan: the loss curve would change."""
    from resihp.trainer_hooks.runtime.recovery import batch_change

    job_plan = Plan.uniform(1, 2, 2, 8, 8)  # the script's: 8 micro-batches per step
    same = Plan.uniform(1, 1, 2, 8, 8)
    smaller = replace(Plan.uniform(1, 1, 2, 8, 4), epoch=1)  # the coordinator's: 4
    assert batch_change(job_plan, same, 64) == ""
    why = batch_change(job_plan, smaller, 64)
    # token shares count in tokens: 5 + 2 micro-batches that hold the 8 of the batch are the same batch
    shares = Plan(replicas=(PipelinePlan(((0,),), (8,), 5, 320), PipelinePlan(((1,),), (8,), 2, 192)))
    assert batch_change(job_plan, shares, 64) == "" and batch_change(shares, job_plan, 64) == ""
    fewer = Plan(replicas=(PipelinePlan(((0,),), (8,), 5, 320), PipelinePlan(((1,),), (8,), 2, 128)))
    assert batch_change(job_plan, fewer, 64).startswith("the plan trains 7 micro-batches per step and this job 8")
    assert why.startswith("the plan trains 4 micro-batches per step and this job 8: a re-plan may not change the "
                          "global batch") and "--microbatches" in why
    tx = _Transport()
    res = _resilience(job_plan, tx)
    with pytest.raises(ValueError, match="the plan trains 4 micro-batches per step and this job 8"):
        res.on_reconfigure(res.job, m.ReconfigCommand(1, smaller, 5, "fail-slow of ranks [3]", 1))
    # the recovery takes the survivor rule at once instead of the coordinator's plan
    tx.commands = [m.ReconfigCommand(2, smaller, 5, "fail-stop of ranks [7]", 1)]
    assert res._wait_coordinator_plan(SimpleNamespace(ranks=tuple(range(7)))) is None
    # refused aloud and dropped: never left pending, to be acknowledged later as if applied
    assert tx.acks == [(1, False, why)] and res.job._pending == [] and res._deferred == []


def test_the_launcher_says_a_layout_mismatch_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from resihp.trainer_hooks.launch.launcher import _JobFinishedWatch

    ev = tmp_path / "events.jsonl"
    ev.write_text(json.dumps({"event": "layout-mismatch", "rank": 0, "reason": "rank 0 ran 4 micro-batch(es)"}) + "\n")
    w = _JobFinishedWatch(ev)
    assert not w.poll() and w.mismatch == "rank 0 ran 4 micro-batch(es)"
    assert capsys.readouterr().err == "resihp launch: rank 0 ran 4 micro-batch(es)\n"
    with open(ev, "a") as fh:  # said once
        fh.write(json.dumps({"event": "layout-mismatch", "rank": 1, "reason": "again"}) + "\n")
    assert not w.poll() and capsys.readouterr().err == ""
