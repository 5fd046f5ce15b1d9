"""``resihp launch --hostfile``: an agent killed on another machine is restarted there, by that
machine's supervisor, and costs no rank and no step.

Two nodes (network namespaces, tests/netns_cluster.py), two ranks each, TP1 × PP2 × DP2 of
gpt-tiny. mpirun starts each node's agent under a node supervisor
(trainer_hooks/launch/node_supervisor.py); the launcher cannot reach a process on another
machine. The second node's agent is killed with SIGKILL mid-training: its supervisor starts it
again on the same hook address, the ranks' hooks reconnect and say hello, and the coordinator,
which held its judgement of the node's silent ranks for the agent's grace, sees them back.
After the job nothing of it is left running on any node.

Second job, restart budget 0: the killed agent stays dead, then a rank of its node stops
(SIGSTOP). The coordinator's fence order has no agent to go to; the node's supervisor, which
gave its agent up, fences the rank in its place, and the survivors train every step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from cp_helpers import rank_pid, read_jsonl, wait_until
from netns_cluster import admin_status, cluster_or_skip, stop

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
STEPS = 60
KILL_AFTER = 10

pytestmark = pytest.mark.flaky(reruns=1)  # real mpirun + ULFM on 2 cores: one fresh retry


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def _left_running(run: Path) -> list[str]:
    """Processes of this job still alive (their environment names its run directory)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RESIHP_RUN_DIR") == str(run) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(proc.cmdline())[:200])
        except (psutil.Error, OSError):
            continue
    return out


def _two_node_job(work: Path, run: Path, budget: int, then: Any) -> dict[str, Any]:
    """Kill the second node's agent at iteration KILL_AFTER, ``then(run, node)``, and run the job to its end."""
    with cluster_or_skip(work / "cluster", 2) as cluster:
        node = cluster.nodes[1]
        line = cluster.launch_command(run, cluster.hostfile(work / "hosts", slots=2),
                                      ["-n", "4", "--pp", "2", "--dp", "2", "--microbatches", "8", "--restart-budget",
                                       str(budget)], ["--agent-grace-s=1"] if budget == 0 else [],
                                      [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--pp", "2", "--dp", "2",
                                       "--microbatches", "8", "--seed", "3", "--threads", "1", "--log-every", "1000"])
        launch = subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO))
        try:
            wait_until(lambda: admin_status(run)["iteration"] >= KILL_AFTER, 120, f"iteration {KILL_AFTER}")
            killed = json.loads((run / f"agent-{node}.json").read_text())["pid"]
            os.kill(killed, signal.SIGKILL)
            extra = then(run, node)
            out, _ = launch.communicate(timeout=240)
        finally:
            stop(launch)
        return {"run": run, "node": node, "killed": killed, "rc": launch.returncode, "out": out,
                "left": _left_running(run), **extra}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def back(run: Path, node: str) -> dict[str, Any]:
        wait_until(lambda: [e for e in _events(run, "agent-back") if e["node"] == node], 60, "the agent back")
        return {"restarted": json.loads((run / f"agent-{node}.json").read_text())["pid"]}

    work = tmp_path_factory.mktemp("agentrestart")
    return _two_node_job(work, work / "run", 5, back)


@pytest.fixture(scope="module")
def agentless(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def stop_a_rank(run: Path, node: str) -> dict[str, Any]:
        wait_until(lambda: [e for e in _events(run, "daemon-gave-up") if e["daemon"] == f"agent {node}"], 60,
                   "the node supervisor giving its agent up")
        stopped = wait_until(lambda: rank_pid(run, 3), 30, "rank 3's process")
        os.kill(stopped, signal.SIGSTOP)
        return {"stopped": stopped}

    work = tmp_path_factory.mktemp("agentless")
    return _two_node_job(work, work / "run", 0, stop_a_rank)


def test_the_node_s_supervisor_restarts_its_agent(job: dict[str, Any]) -> None:
    run, node = job["run"], job["node"]
    assert job["rc"] == 0, job["out"][-3000:]
    exited, = _events(run, "daemon-exited")
    restarted, = _events(run, "daemon-restarted")
    for e in (exited, restarted):
        assert e["daemon"] == f"agent {node}" and e["source"] == f"node-supervisor on {node}", e
    assert exited["code"] == -signal.SIGKILL and restarted["pid"] == job["restarted"] != job["killed"]
    assert [e["node"] for e in _events(run, "agent-registered")].count(node) == 2
    lost, = _events(run, "agent-lost")
    assert lost["node"] == node and lost["ranks"] == [2, 3], lost


def test_no_rank_and_no_step_is_lost(job: dict[str, Any]) -> None:
    run = job["run"]
    assert not [e for e in _events(run, "finding") if e["kind"] == "fail-stop"]
    steps = [x["step"] for x in read_jsonl(run / "progress.jsonl") if x["type"] == "step"]
    assert steps == list(range(STEPS))


def test_nothing_of_the_job_is_left_running_on_any_node(job: dict[str, Any]) -> None:
    assert job["left"] == []


def test_a_rank_of_a_node_whose_agent_is_gone_for_good_is_fenced_by_the_node_s_supervisor(
        agentless: dict[str, Any]) -> None:
    run, node = agentless["run"], agentless["node"]
    assert agentless["rc"] == 0, agentless["out"][-3000:]
    waiting = [e for e in _events(run, "fence") if e["rank"] == 3]
    assert waiting and waiting[0]["sent"] is False and waiting[0]["pid"] == agentless["stopped"], waiting
    fenced = [e for e in _events(run, "fence-result") if e["rank"] == 3]
    assert fenced and fenced[0]["ok"] and fenced[0]["source"] == f"the node supervisor on {node}", fenced
    assert f"SIGKILL sent to pid {agentless['stopped']} on {node}" in fenced[0]["reason"]
    last = {x["step"] for x in read_jsonl(run / "progress.jsonl") if x["type"] == "step"}
    assert last == set(range(STEPS))
    assert agentless["left"] == []
