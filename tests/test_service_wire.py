"""The packed report wire form and the one-pass trace lines: the same values as the generic paths."""
from __future__ import annotations

import json
import math
import random

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import CHUNK_KINDS, ChunkTiming, ExitEvent, IterationRecord, record_to_dict
from resihp.coordinator.protocol import codec, wire
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.coordinator.service.tracefmt import record_line
from resihp.proto import resihp_pb2 as pb
from resihp.trainer_hooks.reporting.trace_writer import RankIteration, iteration_line, join_iteration

KINDS = CHUNK_KINDS  # TP included: every kind crosses the wire


def _report(rank: int, it: int, rng: random.Random, n_chunks: int = 27) -> m.RankReport:
    seqlens = tuple(tuple(rng.randint(1, 128) for _ in range(rng.randint(1, 5))) for _ in range(8))
    chunks = []
    t = 0.0
    for _i in range(n_chunks):
        d = rng.uniform(0.0, 0.02)
        chunks.append(ChunkTiming(rank, rng.choice(KINDS), rng.randint(-1, 7), rng.randint(0, 1), t, t + d))
        t += d
    return m.RankReport(rank, 2, it, 1.7e9 + it * 0.25, rng.uniform(0.1, 0.3), seqlens, tuple(chunks))


def test_packed_report_round_trips_and_is_smaller() -> None:
    rng = random.Random(1)
    for it in range(20):
        rep = _report(it % 4, it, rng, n_chunks=rng.randint(0, 40))
        packed = wire.report_to_wire(rep)
        assert wire.is_packed(packed) == bool(rep.seqlens or rep.chunks)
        back = wire.report_from_wire(pb.RankReport.FromString(packed.SerializeToString()))
        assert back == rep
        assert wire.check_report(packed) == (rep.rank, it)
        if rep.chunks:
            assert packed.ByteSize() < codec.report_to_pb(rep).ByteSize()


def test_per_chunk_form_still_accepted_and_mixed_ranks_fall_back_to_it() -> None:
    rng = random.Random(2)
    rep = _report(1, 3, rng)
    old = codec.report_to_pb(rep)
    assert wire.report_from_wire(old) == rep and wire.check_report(old) == (1, 3)
    mixed = m.RankReport(1, 0, 3, 10.0, 0.5, ((4,),), (ChunkTiming(2, "F", 0, 0, 0.0, 0.1),))
    out = wire.report_to_wire(mixed)
    assert not wire.is_packed(out) and wire.report_from_wire(out) == mixed


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.packed_chunks.start_s.__setitem__(0, math.nan), "packed_chunks[0]: need finite"),
    (lambda r: r.packed_chunks.end_s.__setitem__(1, -1.0), "packed_chunks[1]: need finite"),
    (lambda r: r.packed_chunks.microbatch.append(0), "one entry per chunk"),
    (lambda r: setattr(r.packed_chunks, "kinds", "F,X" + r.packed_chunks.kinds[3:]), "unknown kind(s) ['X']"),
    (lambda r: r.packed_chunks.microbatch.__setitem__(0, -2), "microbatch must be >= -1"),
    (lambda r: r.seqlens_flat.append(5), "seqlens_flat holds"),
    (lambda r: r.seqlens_flat.__setitem__(0, 0), "seqlens_flat must be in 1.."),
    (lambda r: r.seqlens_count.__setitem__(0, 0), "seqlens_count: every micro-batch needs"),
    (lambda r: r.chunks.add(rank=0, kind="F"), "must not also carry"),
    (lambda r: setattr(r, "step_s", -1.0), "step_s"),
    (lambda r: setattr(r, "rank", -3), "rank"),
])
def test_bad_packed_reports_are_refused_naming_the_field(mutate, message) -> None:  # type: ignore[no-untyped-def]
    r = wire.report_to_wire(_report(0, 1, random.Random(3)))
    r.packed_chunks.kinds = "F,F," + ",".join(r.packed_chunks.kinds.split(",")[2:])
    mutate(r)
    for fn in (wire.check_report, wire.report_from_wire):
        with pytest.raises(ValidationError) as exc:
            fn(r, "reports[0]")
        assert "reports[0]" in str(exc.value) and message in str(exc.value)


def test_agent_batch_from_wire_reads_both_forms_and_the_rest_as_the_codec() -> None:
    rng = random.Random(4)
    reps = (_report(0, 5, rng), _report(1, 5, rng))
    batch = m.AgentBatch(agent_id="n#1", node="n", reports=(reps[0],), acks=(m.Ack(1, 3, 1, 5, True, "", 2.0),),
                         exits=(m.RankExit(1, 77, 3.0, -9, False),))
    msg = codec.agent_batch_to_pb(batch)
    msg.reports.append(wire.report_to_wire(reps[1]))
    got = wire.agent_batch_from_wire(pb.AgentMessage.FromString(msg.SerializeToString()))
    assert got.reports == reps and got.acks == batch.acks and got.exits == batch.exits and got.agent_id == "n#1"
    empty = codec.agent_batch_to_pb(m.AgentBatch(agent_id="x"))
    assert wire.agent_batch_from_wire(empty) == codec.agent_batch_from_pb(empty)


def _generic(rec: object) -> str:
    return json.dumps(record_to_dict(rec), separators=(",", ":"))  # type: ignore[arg-type]


def test_record_line_is_the_json_of_record_to_dict() -> None:
    rng = random.Random(5)
    values = [0.0, 1e-12, 1.5e-9, 0.1 + 0.2, 123456.789, 3.0, 2.5e-05, 1 / 3, 7e22]
    for _ in range(200):
        chunks = tuple(ChunkTiming(rng.randint(0, 9), rng.choice(KINDS), rng.randint(-1, 9), rng.randint(0, 2),
                                   rng.choice(values + [rng.random()]), rng.choice(values + [rng.random() * 100]))
                       for _ in range(rng.randint(0, 12)))
        rec = IterationRecord(rng.randint(0, 10**6), rng.choice(values), rng.random(),
                              tuple(tuple(tuple(rng.randint(1, 99) for _ in range(rng.randint(0, 3)))
                                          for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 3))),
                              chunks, {r: rng.choice(values) for r in rng.sample(range(12), rng.randint(0, 3))})
        assert record_line(rec) == _generic(rec)
    odd = IterationRecord(1, 0.5, 0.25, ((),), (ChunkTiming(0, "F", 0, 0, 0.0, math.inf),), {})
    assert record_line(odd) == _generic(odd)  # non-finite: the generic form (Infinity)
    ints = IterationRecord(1, 0, 1, ((),), (ChunkTiming(0, "F", 0, 0, 0, 1),), {0: 1})  # ints where floats belong
    assert record_line(ints) == _generic(ints)
    assert record_line(ExitEvent(3, 1.25, -9)) == _generic(ExitEvent(3, 1.25, -9))


def test_writer_iteration_line_equals_the_joined_record() -> None:
    rng = random.Random(6)
    plan = Plan.uniform(1, 2, 2, 4, 8)
    for it in range(50):
        parts = []
        for rank in rng.sample(plan.ranks(), rng.randint(1, 4)):
            chunks = tuple((rng.choice(KINDS), rng.randint(-1, 3), 0, rng.random() * 0.1, 0.1 + rng.random() * 0.1)
                           for _ in range(rng.randint(0, 10)))
            seq = tuple(tuple(rng.randint(1, 64) for _ in range(2)) for _ in range(4))
            parts.append(RankIteration(rank, it, plan.position(rank).replica, rng.uniform(0.0, 5.0),
                                       rng.uniform(0.1, 0.3), seq, chunks))
        assert iteration_line(it, parts, plan) == _generic(join_iteration(it, parts, plan))


def test_apply_at_counts_the_iterations_run_since_the_newest_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reports arrive up to a flush interval late: apply_at extrapolates where the ranks are now."""
    from resihp.coordinator.model.spec import preset
    from resihp.coordinator.service.config import CoordinatorConfig
    from resihp.coordinator.service.core import CoordinatorCore
    from resihp.coordinator.service.engine import build_header, make_engine
    from resihp.coordinator.service.journal import Journal
    from resihp.coordinator.service.metrics import Registry

    plan = Plan.uniform(1, 2, 1, 8, 8)
    clock = [5000.0]
    core = CoordinatorCore(CoordinatorConfig(world_size=2, pp=2, run_dir=str(tmp_path), apply_lead_s=0.01), plan,
                           make_engine("rules", build_header(preset("gpt-tiny"), plan, 2, "job")),
                           Journal(tmp_path / "journal.jsonl"), tmp_path / "events.jsonl", Registry(), lambda: clock[0])
    conn, _ = core.register(m.Registration("n0", "job", (m.LocalRank(0, 0, 10, reshapes=True), m.LocalRank(1, 1, 11, reshapes=True))))
    for r in (0, 1):  # iteration 10 ended at t=5000.0 on both ranks, 0.25 s a step
        core.on_batch(conn, m.AgentBatch(reports=(m.RankReport(r, 0, 10, 4999.75, 0.25, ((5,),) * 8),)))
    assert core._apply_at() == 10 + 2  # reported just now: newest + margin
    clock[0] = 5001.0  # a second later the ranks are 4 iterations further
    assert core._apply_at() == 10 + 4 + 2
    clock[0] = 5000.1  # part of an iteration counts as a whole one (a later boundary is the safe side)
    assert core._apply_at() == 10 + 1 + 2
    clock[0] = 5005.0  # silent for 5 s: a stall rather than report lag; at most REPORT_LAG_S (2 s) counts
    assert core._apply_at() == 10 + 8 + 2
    clock[0] = 4990.0  # a report from the coordinator's future (clock skew) adds nothing
    assert core._apply_at() == 12
    clock[0] = 6000.0  # nor does one from long ago (a stalled job)
    assert core._apply_at() == 12


def test_niceness_settings_are_checked() -> None:
    from resihp.agent.daemon import AgentConfig
    from resihp.coordinator.service.config import ConfigError, CoordinatorConfig, load_config

    assert load_config(None, {"RESIHP_COORDINATOR_NICE": "10"}, {}).nice == 10
    with pytest.raises(ConfigError, match="nice must be 0..19"):
        CoordinatorConfig(nice=20)
    with pytest.raises(ValueError, match="nice must be 0..19"):
        AgentConfig(nice=-1)
