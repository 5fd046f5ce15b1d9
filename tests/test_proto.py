"""The protocol: generated code is current, and the codec round-trips and validates."""
from __future__ import annotations

import filecmp
import math
from pathlib import Path

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.proto import regen
from resihp.proto import resihp_pb2 as pb


def test_regenerating_into_a_temp_dir_matches_the_checked_in_code(tmp_path: Path) -> None:
    written = regen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(regen.OUTPUTS)
    for name in regen.OUTPUTS:
        assert filecmp.cmp(tmp_path / name, regen.HERE / name, shallow=False), f"{name} is stale: run make proto"
    grpc_code = (tmp_path / "resihp_pb2_grpc.py").read_text()
    assert "from resihp.proto import resihp_pb2" in grpc_code  # the staging tree gives package imports
    assert pb.DESCRIPTOR.package == "resihp.v1"


def test_report_and_commands_round_trip() -> None:
    rep = m.RankReport(3, 1, 42, 1700000000.5, 0.25, ((100, 28), (64,)), (ChunkTiming(3, "F", 0, 0, 0.0, 0.01),))
    assert codec.report_from_pb(codec.report_to_pb(rep)) == rep
    plan = Plan.uniform(1, 2, 2, 4, 4)
    for cmd in (m.ReconfigCommand(2, plan, 17, "why", 5, (), 1.5), m.ThrottleCommand(2, 2.5, 3, "slow", 6, (1,)),
                m.DrainCommand(2, 9, "bye", 7)):
        assert codec.command_from_pb(codec.command_to_pb(cmd)) == cmd
    batch = m.AgentBatch("a#1", "n0", (rep,), (m.Ack(3, 5, 2, 17),), (m.RankExit(3, 99, 2.0, -9),),
                         heartbeat=m.AgentHeartbeat(3.0, (m.RankHeartbeat(3, 2.9, 41),)))
    assert codec.agent_batch_from_pb(codec.agent_batch_to_pb(batch)) == batch


@pytest.mark.parametrize("mutate, message", [
    (lambda r: setattr(r, "step_s", math.nan), "report.step_s must be a finite number >= 0"),
    (lambda r: setattr(r, "start_s", -1.0), "report.start_s must be a finite number >= 0"),
    (lambda r: setattr(r, "rank", -2), "report.rank must be a rank"),
    (lambda r: r.microbatches.add(), r"report.microbatches\[1\] has no sequence lengths"),
    (lambda r: r.chunks.add(rank=0, kind="Z"), r"report.chunks\[0\].kind must be one of"),
    (lambda r: r.chunks.add(rank=0, kind="F", start_s=2, end_s=1), r"report.chunks\[0\] ends \(1.0\) before"),
    (lambda r: r.microbatches[0].seqlens.extend([0]), r"seqlens must be in 1\.\."),
])
def test_malformed_reports_are_refused_with_the_field_named(mutate: object, message: str) -> None:
    r = codec.report_to_pb(m.RankReport(0, 0, 1, 10.0, 0.5, ((8,),)))
    mutate(r)  # type: ignore[operator]
    with pytest.raises(ValidationError, match=message):
        codec.report_from_pb(r)


def test_size_caps_and_command_bodies() -> None:
    r = pb.RankReport(rank=0, step_s=1.0)
    for _ in range(codec.MAX_MICROBATCHES + 1):
        r.microbatches.add(seqlens=[1])
    with pytest.raises(ValidationError, match="limit is 4096"):
        codec.report_from_pb(r)
    with pytest.raises(ValidationError, match="command has no body"):
        codec.command_from_pb(pb.Command(seq=1))
    with pytest.raises(ValidationError, match="throttle.factor"):
        codec.command_from_pb(pb.Command(seq=1, throttle=pb.Throttle(factor=-1)))
    with pytest.raises(ValidationError, match="not a valid plan"):
        codec.command_from_pb(pb.Command(seq=1, reconfigure=pb.Reconfigure(plan_json="{\"replicas\": []}")))
    with pytest.raises(ValidationError, match="register.node is empty"):
        codec.registration_from_pb(pb.RegisterRequest())
