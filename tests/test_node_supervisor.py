"""A machine's supervisor of its agent (``--hostfile`` jobs) and the fencing of orders no agent
will carry out: the pending-order logic on its own, then the real supervisor process restarting
a real child, giving up after its budget, fencing a real process of the job and stopping on
SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cp_helpers import read_jsonl, wait_until

from resihp.trainer_hooks.launch.orphan_fences import OrphanFences

JOB = "job-node-supervisor-test"


def _append(path: Path, *events: dict[str, Any], partial: str = "") -> None:
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(e) + "\n" for e in events) + partial)


def _fences(path: Path) -> tuple[OrphanFences, list[tuple[int, str]]]:
    killed: list[tuple[int, str]] = []

    def kill(pid: int, node: str) -> tuple[bool, str]:
        killed.append((pid, node))
        return True, f"SIGKILL sent to pid {pid} on {node}"

    return OrphanFences(path, JOB, "the launcher", kill=kill, owned=lambda pid, job: pid != 666 and job == JOB), killed


def test_only_orders_waiting_on_an_agentless_node_are_fenced_once(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    fences, killed = _fences(log)
    assert fences.poll({"node1"}) == [] and killed == []  # no log yet
    _append(log, {"event": "fence", "rank": 3, "node": "node1", "pid": 4242, "sent": False},
            {"event": "fence", "rank": 1, "node": "node0", "pid": 4141, "sent": False},
            {"event": "fence", "rank": 5, "node": "node1", "pid": 4545, "sent": False},
            {"event": "fence", "rank": 5, "node": "node1", "pid": 4545, "sent": True},  # its agent came back
            {"event": "finding", "rank": "not an int"})
    lines = fences.poll({"node1"})
    assert killed == [(4242, "node1")]
    assert len(lines) == 1 and lines[0].startswith("rank 3: its agent on node1 is gone for good; the launcher fenced")
    assert set(fences.pending) == {1}  # node0's agent may still come back
    assert fences.poll({"node1"}) == [] and killed == [(4242, "node1")]  # once
    recorded = [e for e in read_jsonl(log) if e["event"] == "fence-result"]
    assert [(e["rank"], e["ok"], e["source"]) for e in recorded] == [(3, True, "the launcher")]
    # a line read half-written is taken once it is whole; an order carried out meanwhile is dropped
    _append(log, partial='{"event": "fence", "rank": 7, "no')
    assert fences.poll({"node1"}) == [] and set(fences.pending) == {1}
    _append(log, partial='de": "node0", "pid": 666, "sent": false}\n')
    _append(log, {"event": "fence-result", "rank": 1, "ok": True, "node": "node0"})
    fences.read()
    assert set(fences.pending) == {7}
    fences.poll({"node0"})
    assert killed == [(4242, "node1")]  # pid 666 is not the job's any more: recorded, not killed
    last = read_jsonl(log)[-1]
    assert last["rank"] == 7 and last["ok"] and "no longer a process of job" in last["reason"]


CHILD = "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(600)"


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_real_supervisor_restarts_its_agent_gives_up_then_fences_and_stops_on_sigterm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    started = tmp_path / "started"
    env = {**os.environ, "RESIHP_NODE": "nodeX", "RESIHP_JOB": JOB}
    sup = subprocess.Popen([sys.executable, "-m", "resihp.trainer_hooks.launch.node_supervisor", "--job", JOB,
                            "--run-dir", str(run), "--restart-budget", "1", "--", sys.executable, "-c", CHILD,
                            str(started)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        first, = wait_until(lambda: _pids(started), 30, "the agent started")
        os.kill(first, signal.SIGKILL)
        second = wait_until(lambda: _pids(started)[1:], 30, "the agent restarted")[0]
        events = run / "events.jsonl"
        os.kill(second, signal.SIGKILL)
        gave_up = wait_until(lambda: [e for e in read_jsonl(events) if e["event"] == "daemon-gave-up"], 30, "give-up")
        assert gave_up[0]["daemon"] == "agent nodeX" and gave_up[0]["source"] == "node-supervisor on nodeX"
        kinds = [e["event"] for e in read_jsonl(events)]
        assert kinds == ["daemon-exited", "daemon-restarted", "daemon-gave-up"], kinds
        # a rank of this job on this node, declared dead while its agent is gone for good
        victim = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                                  env=env, stdout=subprocess.PIPE, text=True)
        assert victim.stdout is not None and victim.stdout.readline() == "up\n"  # exec'd: its environ is the job's
        _append(events, {"event": "fence", "rank": 2, "node": "nodeX", "pid": victim.pid, "sent": False})
        assert victim.wait(30) == -signal.SIGKILL
        result = wait_until(lambda: [e for e in read_jsonl(events) if e["event"] == "fence-result"], 30, "fence-result")
        assert result[0]["rank"] == 2 and result[0]["ok"] and f"SIGKILL sent to pid {victim.pid}" in result[0]["reason"]
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0
    finally:
        for p in (sup, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_the_supervisor_ends_its_agent_when_mpirun_ends_it(tmp_path: Path) -> None:
    started = tmp_path / "started"
    sup = subprocess.Popen([sys.executable, "-m", "resihp.trainer_hooks.launch.node_supervisor", "--job", JOB,
                            "--", sys.executable, "-c", CHILD, str(started)],
                           env={**os.environ, "RESIHP_NODE": "nodeY"}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        agent, = wait_until(lambda: _pids(started), 30, "the agent started")
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0
        assert not Path(f"/proc/{agent}").exists()  # ended and reaped
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_the_supervisor_refuses_a_missing_agent_command() -> None:
    done = subprocess.run([sys.executable, "-m", "resihp.trainer_hooks.launch.node_supervisor", "--job", JOB],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the agent's command line is missing" in done.stderr
