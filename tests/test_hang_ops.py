"""Hang localisation when every rank beats on (issue #25, item 4): each heartbeat names the op
its rank entered last and whether it completed it; a job with no progress is held up by the
rank that waits for nobody while its peers wait for it in p2p or collective ops. The pure
rule, the trace format, the detector on a generated trace, the coordinator over the wire
messages, and the hooks' op cursor."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import read_jsonl, wait_until
from test_detector import PLAN, _cfg, _replay

from resihp.coordinator.detector.detector import Detector
from resihp.coordinator.detector.hangs import (
    HELD_SHARE,
    STATE_SETTLE_S,
    STUCK_HELD_MIN_S,
    STUCK_HELD_SHARE,
    hang_culprits,
    stuck_culprits,
)
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import HeartbeatEvent, IterationRecord, OpState, TraceError, read_trace, write_trace
from resihp.coordinator.protocol import codec
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.protocol.codec import ValidationError
from resihp.proto import resihp_pb2 as pb
from resihp.sim.workload import Fault, make_header, records_list
from resihp.trainer_hooks.reporting.opcursor import OpCursor

STUCK = OpState("compute", "F mb2", False, 40)
RECV = OpState("p2p", "recv F mb2 from 1", False, 38)
DP = OpState("collective", "DP all-reduce", False, 90)
RESIHP = [sys.executable, "-m", "resihp.cli"]


def test_the_rank_that_waits_for_nobody_is_named() -> None:
    ops = {0: RECV, 1: STUCK, 2: DP, 3: DP}
    fresh = {r: 0.5 for r in ops}
    assert stuck_culprits(5.0, 3.0, ops, fresh) == [1]
    # a rank between ops (its last one completed: a data loader that never returns) too
    assert stuck_culprits(5.0, 3.0, {**ops, 1: OpState("collective", "DP all-reduce", True, 91)}, fresh) == [1]


@pytest.mark.parametrize(("why", "stalled", "ops", "ages"), [
    ("not stalled yet", 2.0, {0: RECV, 1: STUCK, 2: DP, 3: DP}, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}),
    ("a state from before the job stopped", 5.0, {0: RECV, 1: STUCK, 2: DP, 3: DP}, {0: 0.1, 1: 4.5, 2: 0.1, 3: 0.1}),
    ("a rank that names no op (a user's own loop)", 5.0, {0: RECV, 1: STUCK, 2: DP, 3: None}, {0: 0.1, 1: 0.1, 2: 0.1}),
    ("everyone waits (a lost message, a dead link)", 5.0, {0: RECV, 1: RECV, 2: DP, 3: DP}, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}),
    ("half wait for nobody", 5.0, {0: STUCK, 1: STUCK, 2: DP, 3: DP}, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}),
])
def test_nobody_is_named_without_clear_evidence(why: str, stalled: float, ops: dict[int, OpState | None],
                                                 ages: dict[int, float]) -> None:
    assert stuck_culprits(stalled, 3.0, ops, ages) == [], why


def test_a_rank_that_keeps_entering_ops_is_slow_not_stuck() -> None:
    """The rank its peers wait for, but whose beats name a new op every time (a severe
    fail-slow: ten times slower, it still moves from op to op), is not named, nor one that held
    an op across two beats a second apart (80x slower on a loaded host: its ops take a second);
    once it holds one op for half the hang wait, and two seconds at least, it is."""
    ops = {0: RECV, 1: STUCK, 2: DP, 3: DP}
    fresh = {r: 0.5 for r in ops}
    moving = {0: 9.0, 1: 0.3, 2: 9.0, 3: 9.0}
    assert stuck_culprits(5.0, 3.0, ops, fresh, moving) == []
    assert STUCK_HELD_MIN_S == 2.0 and STUCK_HELD_SHARE == 0.5
    assert stuck_culprits(5.0, 3.0, ops, fresh, {**moving, 1: 1.99}) == []  # at a 3 s wait: the 2 s minimum
    assert stuck_culprits(5.0, 3.0, ops, fresh, {**moving, 1: 2.0}) == [1]
    assert stuck_culprits(9.0, 8.0, ops, fresh, {**moving, 1: 3.99}) == []  # at an 8 s wait: half of it
    assert stuck_culprits(9.0, 8.0, ops, fresh, {**moving, 1: 4.0}) == [1]


def test_a_silent_rank_is_no_culprit_while_another_still_moves_on() -> None:
    """Rank 0's beats are late (a heartbeat thread starved on a loaded host) in a stall that is
    rank 2's doing: rank 2 names a new op at every beat (many times slower, not stopped). The
    job is slow, so nobody is named; once every rank that beats holds its op, the silent one is."""
    silence = {0: 1.7, 1: 0.3, 2: 0.4, 3: 0.2}
    held = {1: 2.0, 2: 0.0, 3: 2.0}
    assert hang_culprits(2.8, 2.0, silence) == [0]  # the rule without op states
    assert hang_culprits(2.8, 2.0, silence, held) == []
    assert hang_culprits(2.8, 2.0, silence, {**held, 2: HELD_SHARE * 2.0}) == [0]


def test_an_op_state_must_be_reported_after_the_job_stopped() -> None:
    ops = {0: RECV, 1: STUCK, 2: DP}
    stalled = 4.0
    assert stuck_culprits(stalled, 3.0, ops, {r: stalled - STATE_SETTLE_S - 0.01 for r in ops}) == [1]
    assert stuck_culprits(stalled, 3.0, ops, {r: stalled - STATE_SETTLE_S + 0.01 for r in ops}) == []


def test_heartbeat_ops_round_trip_through_the_trace_and_bad_ones_are_named() -> None:
    header = make_header(_cfg())
    out = io.StringIO()
    write_trace(out, header, [HeartbeatEvent(3, 1.5, STUCK), HeartbeatEvent(4, 1.5)])
    _, records = read_trace(io.StringIO(out.getvalue()))
    assert list(records) == [HeartbeatEvent(3, 1.5, STUCK), HeartbeatEvent(4, 1.5)]
    lines = out.getvalue().splitlines()
    bad = lines[1].replace('"kind":"compute"', '"kind":"gemm"')
    with pytest.raises(TraceError, match=r"line 2: field 'op': op kind must be one of \('compute', 'p2p', 'collective'\)"):
        list(read_trace(io.StringIO("\n".join([lines[0], bad])))[1])
    bad = lines[1].replace('"done":false', '"done":"no"')
    with pytest.raises(TraceError, match="field 'op': needs kind .*done \\(true/false\\)"):
        list(read_trace(io.StringIO("\n".join([lines[0], bad])))[1])


def test_heartbeat_ops_cross_the_wire_and_bad_ones_are_refused() -> None:
    beat = m.RankHeartbeat(2, 10.0, 7, RECV)
    assert codec.heartbeat_from_pb(codec.heartbeat_to_pb(beat)) == beat
    assert codec.heartbeat_from_pb(codec.heartbeat_to_pb(m.RankHeartbeat(2, 10.0, 7))).op is None
    with pytest.raises(ValidationError, match="heartbeats\\[0\\]: op kind must be one of"):
        codec.heartbeat_op_from_pb(pb.RankHeartbeat(rank=2, time_s=1.0, op_kind="nccl"), "heartbeats[0]")


@pytest.mark.parametrize("rank", [0, 5, 7])
def test_a_rank_stuck_in_an_op_is_found_in_a_generated_trace(rank: int) -> None:
    """Heartbeats go on from every rank; the stuck one names its compute op, the others the
    p2p and collective ops they wait in. It is named within two iterations and a second."""
    cfg = _cfg((Fault("stop", rank, 15, exit_event=False, stuck=True),), heartbeats=True)
    its = [r for r in records_list(cfg) if isinstance(r, IterationRecord)]
    usual = sorted(r.time_s for r in its)[len(its) // 2]
    died = its[-1].start_s + its[-1].time_s + 0.4 * its[-1].time_s
    _, found, _ = _replay(cfg)
    assert [(f.kind, f.ranks, f.cause) for f in found] == [("fail-stop", (rank,), "no-progress")]
    assert found[0].time_s - died <= 2 * usual + 1.0
    assert "waits for nobody" in found[0].reason and "'F mb2'" in found[0].reason


@pytest.mark.parametrize("moving", [True, False])
def test_a_severely_slow_rank_is_not_taken_for_a_hung_one(moving: bool) -> None:
    """An iteration that runs 8x its usual time because rank 5 is 8x slower: every beat, rank 5
    names a new compute op while the others wait for it. The job is slow, not stuck: no
    no-progress verdict (which fences, i.e. kills, the rank). The same beats with rank 5 in one
    op all along are a hang, and it is named."""
    cfg = _cfg(heartbeats=True)
    det, found, _ = _replay(cfg, Detector(make_header(cfg)))
    assert found == []
    its = [r for r in records_list(cfg) if isinstance(r, IterationRecord)]
    usual = sorted(r.time_s for r in its)[len(its) // 2]
    start = its[-1].start_s + its[-1].time_s
    assert 8 * usual > det.hang_after_s() + 1.0  # the slow iteration outlasts the hang wait
    beats = int(8 * usual / 0.5)
    for k in range(1, beats):
        t = start + 0.5 * k
        for r in PLAN.ranks():
            op = (OpState("compute", f"F mb{k % 8}", False, 40 + k) if moving else STUCK) if r == 5 else RECV
            found += det.observe(HeartbeatEvent(r, t, op), t) + det.tick(t)
    stops = [(f.kind, f.ranks, f.cause) for f in found]
    assert stops == ([] if moving else [("fail-stop", (5,), "no-progress")])


def test_the_coordinator_names_the_stuck_rank_from_the_agents_beats(tmp_path: Path) -> None:
    from test_coordinator import _chunked, _clocked_core, _one_agent

    plan = Plan.uniform(1, 2, 2, 8, 4)
    core, t = _clocked_core(tmp_path, plan, heartbeat_timeout_s=1000.0)
    conn = _one_agent(core, 4)
    for it in range(4):
        core.on_batch(conn, m.AgentBatch(reports=tuple(_chunked(r, it, 0, plan) for r in range(4))))
        t[0] += 0.2
    ops = {0: DP, 1: DP, 2: STUCK, 3: RECV}

    def hangs() -> list[dict[str, Any]]:
        return [e for e in core.events.since(0, 1000) if e["event"] == "finding" and e.get("cause") == "no-progress"]

    for second in range(4):
        t[0] += 1.0
        beats = tuple(m.RankHeartbeat(r, t[0], 3, ops[r] if second else None) for r in range(4))
        core.on_batch(conn, m.AgentBatch(heartbeat=m.AgentHeartbeat(t[0], beats)))
        core.tick()
        if second == 0:
            assert hangs() == []  # no op named yet: nobody is accused
    found = hangs()
    assert [f["ranks"] for f in found] == [[2]], found
    assert "rank 2 is in compute op 'F mb2'" in found[0]["reason"] and "ranks 0, 1, 3 wait" in found[0]["reason"]


def test_the_cursor_marks_nested_ops_and_completion() -> None:
    cur = OpCursor()
    assert cur.snapshot() == (0, "", "", True)
    with cur.op("compute", "F mb0"):
        assert cur.snapshot() == (1, "compute", "F mb0", False)
        with cur.op("collective", "TP all-reduce"):
            assert cur.snapshot() == (2, "collective", "TP all-reduce", False)
        assert cur.snapshot() == (2, "compute", "F mb0", False)  # back inside the forward
    assert cur.snapshot() == (2, "compute", "F mb0", True)
    with pytest.raises(RuntimeError), cur.op("p2p", "recv"):
        raise RuntimeError("a failed receive")
    assert cur.snapshot() == (3, "p2p", "recv", True)


@contextmanager
def _launched_pp2dp2(tmp_path: Path) -> Iterator[Callable[[str, float, Callable[[], Any]], Any]]:
    """``resihp launch`` (mpirun, agents, coordinator) of examples/train_gpt.py, PP2 x DP2 on
    two nodes, run until the block ends; yields ``until(what, timeout, check)``, which waits for
    ``check()`` to return something truthy while the job lives. The launcher is stopped as on
    Ctrl-C afterwards, and no process of the job may outlive it."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [*RESIHP, "launch", "-n", "4", "--tp", "1", "--pp", "2", "--dp", "2", "--nodes", "2", "--run-dir", str(tmp_path),
           "--", sys.executable, str(repo / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "2", "--dp", "2",
           "--steps", "100000", "--log-every", "1000000"]
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def until(what: str, timeout: float, check: Callable[[], Any]) -> Any:
        def alive_and() -> Any:
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before {what}: {log.read_text()[-3000:]}"
            return check()
        return wait_until(alive_and, timeout, what, interval=0.2)

    try:
        yield until
    finally:
        # the launcher stops what it started (its daemons run in sessions of their own), as on
        # Ctrl-C; a group kill only if it does not
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the job outlived its launcher: {left}"


def _findings(tmp_path: Path, **match: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(tmp_path / "events.jsonl") if e.get("event") == "finding"
            and all(e.get(k) == v for k, v in match.items())]


def _throttle(tmp_path: Path, rank: int, factor: float) -> None:
    done = subprocess.run([*RESIHP, "admin", "inject", "slow", "--rank", str(rank), "--factor", str(factor),
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _steps(tmp_path: Path, at_least: int) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(tmp_path / "progress.jsonl") if r.get("type") == "step" and r["step"] >= at_least]


# One retry: on 2 loaded cores the x1000-throttled rank's ops still end every few seconds, and a
# beat can catch it in its send wait while its pipeline neighbour computes (once in about four
# full runs the neighbour was named); a wrong rank twice in a row is a regression.
@pytest.mark.flaky(reruns=1)
def test_a_real_rank_stuck_in_a_compute_op_is_named_while_every_rank_beats_on(tmp_path: Path) -> None:
    """The real thing: rank 2 is made to stall inside its compute ops (the hooks' throttle at
    x1000: each op takes seconds, as behind a kernel that does not return), while its heartbeat
    thread goes on. Its pipeline peer waits in a receive, the other replica in the DP
    all-reduce; the coordinator names rank 2, cause no-progress, from the ops the heartbeats
    carry — well before any heartbeat timeout."""
    with _launched_pp2dp2(tmp_path) as until:
        until("20 steps", 180, lambda: _steps(tmp_path, 20))
        _throttle(tmp_path, 2, 1000)
        injected = time.monotonic()
        hung = until("no-progress finding", 60, lambda: _findings(tmp_path, cause="no-progress"))
        took = time.monotonic() - injected
        assert [(e["kind"], e["ranks"]) for e in hung] == [("fail-stop", [2])], hung
        assert "rank 2 is in compute op" in hung[0]["reason"] and "waits for nobody" in hung[0]["reason"], hung[0]
        assert not _findings(tmp_path, cause="heartbeat")
        print(f"stuck rank named {took:.1f} s after the inject command")


# One retry: 1 failure in 8 runs beside a CPU-bound benchmark on the same 2 cores (before the
# stuck rule's 2 s minimum, 1 in about 4 CI runs); the verdict's reason is in the message
@pytest.mark.flaky(reruns=1)
def test_a_real_rank_many_times_slower_is_found_slow_not_hung(tmp_path: Path) -> None:
    """The same job with rank 2 throttled x80: each of its ops takes about half a second, so an
    iteration outlasts the hang wait (2 s here) while its peers wait for it, yet no two
    heartbeats (a second apart) find it in the same op. It is a fail-slow on rank 2, and nobody
    is declared hung (a no-progress verdict kills the rank it names)."""
    with _launched_pp2dp2(tmp_path) as until:
        first = until("20 steps", 180, lambda: _steps(tmp_path, 20))[0]["step"]
        _throttle(tmp_path, 2, 80)
        until("a finding", 120, lambda: _findings(tmp_path, kind="fail-slow") or _findings(tmp_path, cause="no-progress"))
        assert not _findings(tmp_path, cause="no-progress"), [(e["ranks"], e["reason"]) for e in _findings(tmp_path)]
        slow = _findings(tmp_path, kind="fail-slow")
        assert [e["ranks"] for e in slow] == [[2]], slow
        # iterations really ran past the hang wait (its 2 s floor: gpt-tiny's usual step is a
        # tenth of that) while rank 2 was being found
        long = [r["step_s"] for r in _steps(tmp_path, first) if r["step_s"] > 2.0]
        assert long, [r["step_s"] for r in _steps(tmp_path, first)]
