"""Dead means fenced; an agent is not its ranks (coordinator/service/fencing.py), on the core
with a clock the test moves; the agent's side of a fence against a real process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from test_coordinator import _clocked_core

from resihp.agent.fence_pid import is_job_process
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.core import CoordinatorCore
from resihp.coordinator.service.records import AgentConn


def _kills(conn: AgentConn) -> list[m.KillOrder]:
    out: list[m.KillOrder] = []
    while not conn.outbox.empty():
        batch = conn.outbox.get_nowait()
        if batch is not None:
            out += batch.kills
    return out


def _two_nodes(core: CoordinatorCore) -> tuple[AgentConn, AgentConn]:
    a = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, True) for r in (0, 1))))[0]
    b = core.register(m.Registration("n1", "job", tuple(m.LocalRank(r, r - 2, 100 + r, True) for r in (2, 3))))[0]
    core.stream_opened(a)
    core.stream_opened(b)
    return a, b


def _beat(core: CoordinatorCore, conn: AgentConn, ranks: tuple[int, ...], now: float) -> None:
    core.on_batch(conn, m.AgentBatch(heartbeat=m.AgentHeartbeat(now, tuple(m.RankHeartbeat(r, now, 5) for r in ranks))))


def test_a_silent_rank_is_fenced_by_its_agent_with_its_pid_and_an_exited_one_is_not(tmp_path: Path) -> None:
    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 2, 8, 4))
    a, b = _two_nodes(core)
    for conn in (a, b):
        _kills(conn)
    core.on_batch(a, m.AgentBatch(exits=(m.RankExit(1, 101, 1.0, -9),)))  # gone already: nothing to fence
    assert _kills(a) == [] and _kills(b) == []
    t[0] += 10.0
    _beat(core, a, (0,), t[0])
    _beat(core, b, (2,), t[0])  # rank 3 stays silent past the heartbeat timeout
    core.tick()
    kills = _kills(b)
    assert [(k.rank, k.fence, k.pid) for k in kills] == [(3, True, 103)] and "heartbeat" in kills[0].reason
    assert _kills(a) == []
    ev = [e for e in core.events.since(0, 500) if e["event"] == "fence"]
    assert ev and ev[0]["rank"] == 3 and ev[0]["sent"] is True
    # the agent says it is done: the order is settled; the process's exit settles it too
    core.on_batch(b, m.AgentBatch(injections=(m.InjectResult("fence", 3, True, "SIGKILL sent to pid 103"),)))
    assert 3 not in core.fences


def test_a_lost_agents_ranks_are_not_judged_by_silence_and_its_fences_wait_for_its_restart(tmp_path: Path) -> None:
    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 2, 8, 4), agent_grace_s=30.0)
    a, b = _two_nodes(core)
    core.stream_closed(b, "agent killed")
    assert "n1" in core.lost_agents
    t[0] += 10.0  # well past the 3 s heartbeat timeout, inside the agent's grace
    _beat(core, a, (0, 1), t[0])
    core.tick()
    assert not any(core.ranks[r].dead for r in (2, 3))
    assert [e["event"] for e in core.events.since(0, 500)].count("finding") == 0
    # a fence ordered while the agent is away waits, and goes to the restarted agent
    core._findings([m.FindingInfo(5, "fail-stop", (2,), "no-progress", 1.0, "stuck", t[0])], t[0])
    assert 2 in core.fences and _kills(b) == []
    b2 = core.register(m.Registration("n1", "job", (m.LocalRank(3, 1, 103, True),)))[0]
    core.stream_opened(b2)
    assert [(k.rank, k.fence, k.pid) for k in _kills(b2)] == [(2, True, 102)]
    assert "n1" not in core.lost_agents  # rank 3, its only live rank, met the new agent
    # once back, silence counts again
    t[0] += 10.0
    _beat(core, a, (0, 1), t[0])
    core.tick()
    assert core.ranks[3].dead


def test_the_grace_ends_and_a_rank_that_never_came_back_is_judged(tmp_path: Path) -> None:
    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 2, 8, 4), agent_grace_s=5.0)
    a, b = _two_nodes(core)
    core.stream_closed(b, "agent killed")
    t[0] += 4.0
    _beat(core, a, (0, 1), t[0])
    core.tick()
    assert not core.ranks[2].dead
    t[0] += 2.0  # past the grace, no agent, no progress: its silence counts
    _beat(core, a, (0, 1), t[0])
    core.tick()
    assert core.ranks[2].dead and core.ranks[3].dead


def test_a_rank_declared_dead_that_shows_up_again_is_fenced_again(tmp_path: Path) -> None:
    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 2, 8, 4))
    a, b = _two_nodes(core)
    core._findings([m.FindingInfo(5, "fail-stop", (3,), "no-progress", 1.0, "stuck", t[0])], t[0])
    core.on_batch(b, m.AgentBatch(injections=(m.InjectResult("fence", 3, False, "agent could not"),)))
    _kills(b)
    core.stream_closed(b, "agent restarted")
    b2 = core.register(m.Registration("n1", "job", (m.LocalRank(2, 0, 102, True), m.LocalRank(3, 1, 103, True))))[0]
    kills = _kills(b2)
    assert kills and all(k.rank == 3 and k.fence and k.pid == 103 for k in kills)
    assert core.ranks[3].dead  # not readmitted: the same process
    reasons = [e["reason"] for e in core.events.since(0, 500) if e["event"] == "fence"]
    assert any("showed up after it was declared dead" in r for r in reasons)


def test_the_agent_fences_by_pid_only_a_process_of_its_own_job(tmp_path: Path) -> None:
    env = {**os.environ, "RESIHP_JOB": "job-fence-test"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # exec'd: /proc shows its own environ
        assert is_job_process(proc.pid, "job-fence-test")
        assert not is_job_process(proc.pid, "another-job")
        assert not is_job_process(os.getpid(), "job-fence-test")
        os.kill(proc.pid, signal.SIGSTOP)  # a stopped process dies of a SIGKILL all the same
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


def test_a_second_death_during_a_recovery_is_folded_into_it_at_once(tmp_path: Path) -> None:
    """Two ranks killed together: the plan for the first still needs the second. The survivors
    wait for a plan that uses only survivors, so the coordinator supersedes the first plan at
    once (before, they waited 20 s and fell back on their own rule)."""
    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 4, 8, 8))
    conn = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, True) for r in range(8))))[0]
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(2, 102, 1.0, -9),)))
    first = [c for b in _drain(conn) for c in b.commands if isinstance(c, m.ReconfigCommand)]
    assert len(first) == 1 and not first[0].plan.has_rank(2)
    second_victim = next(r for r in first[0].plan.ranks() if r != 0)
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(second_victim, 100 + second_victim, 1.01, -9),)))
    again = [c for b in _drain(conn) for c in b.commands if isinstance(c, m.ReconfigCommand)]
    assert len(again) == 1 and again[0].epoch == first[0].epoch + 1
    assert not again[0].plan.has_rank(2) and not again[0].plan.has_rank(second_victim)
    assert again[0].reason.startswith("fail-stop")
    assert core.pending is not None and core.pending.command.seq == again[0].seq
    kinds = [e["event"] for e in core.events.since(0, 500)]
    assert kinds.count("command-superseded") == 1 and kinds.count("finding") == 2
    # every live rank acknowledging the new plan ends the switch; the superseded one is not waited for
    for r in again[0].plan.ranks() + tuple(again[0].plan.spares):
        core.on_batch(conn, m.AgentBatch(acks=(m.Ack(r, again[0].seq, again[0].epoch, again[0].apply_at),)))
    assert core.pending is None and core.plan == again[0].plan


def _drain(conn: AgentConn) -> list[m.CoordinatorBatch]:
    out = []
    while not conn.outbox.empty():
        b = conn.outbox.get_nowait()
        if b is not None:
            out.append(b)
    return out


def test_the_coordinator_follows_trainers_that_moved_to_a_newer_epoch_on_their_own(tmp_path: Path) -> None:
    """A recovery with nobody lost (the store restarted under a boundary's agreement) gives the
    trainers a new epoch with the same layout; their reports are taken, not dropped as from an
    unknown epoch (which had stopped the iterations and made a live rank look hung)."""
    from test_coordinator import _rep

    core, t = _clocked_core(tmp_path, Plan.uniform(1, 2, 2, 8, 4))
    conn = core.register(m.Registration("n0", "job", tuple(m.LocalRank(r, r, 100 + r, True) for r in range(4))))[0]
    core.on_batch(conn, m.AgentBatch(reports=(_rep(0, 3, epoch=1),)))
    assert core.epoch == 1 and core.plan.epoch == 1 and core.ranks[0].iteration == 3
    assert [e["event"] for e in core.events.since(0, 100)].count("epoch-adopted") == 1
    core.on_batch(conn, m.AgentBatch(exits=(m.RankExit(3, 103, 1.0, -9),)))
    cmd = next(c for b in _drain(conn) for c in b.commands if isinstance(c, m.ReconfigCommand))
    assert cmd.epoch == 2  # newer than what the trainers run
