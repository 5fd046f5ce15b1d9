"""One machine's supervision of its node agent, in a ``resihp launch --hostfile`` job.

There ``mpirun`` starts one agent per machine (launcher.agents_command), out of the launcher's
reach: the launcher cannot see, let alone restart, a process on another machine. So mpirun
starts this supervisor instead, and it runs the agent as its child: a dead agent is started
again on the same hook address (where its ranks' hooks reconnect) after the launcher's backoff,
within the launcher's restart budget (launch/supervise.py), and each exit and restart goes to
the job's event log when this machine sees the run directory (a shared file system), else to
its output (the launcher's ``agents.log``). Once the budget is spent, it fences in the agent's
place: a rank of this node that the coordinator declares dead is SIGKILLed from here
(launch/orphan_fences.py; needs the shared run directory, where the orders are).

Signals (mpirun's teardown, an operator's ^C) end the agent first, then this process.

Usage: python -m resihp.trainer_hooks.launch.node_supervisor --job JOB --run-dir DIR
       [--restart-budget N] -- AGENT COMMAND...
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from resihp.agent.main import default_node
from resihp.trainer_hooks.launch.orphan_fences import OrphanFences
from resihp.trainer_hooks.launch.supervise import Supervisor

POLL_S = 0.1  # how soon an agent's exit is seen: its backoff (≥ 0.2 s) dominates a restart


def _start_agent(argv: list[str], env: Mapping[str, str], _log: IO[bytes]) -> subprocess.Popen[bytes]:
    # the agent writes where this process does (mpirun forwards it); same process group, so a
    # signal mpirun sends to the group reaches both
    return subprocess.Popen(argv, env=dict(env))


def run(agent: Sequence[str], job: str, run_dir: str, budget: int, env: Mapping[str, str]) -> int:
    node = default_node(env)
    events = Path(run_dir) / "events.jsonl" if run_dir and Path(run_dir).is_dir() else None
    supervisor = Supervisor(events, job, budget=budget, start=_start_agent, source=f"node-supervisor on {node}")
    proc = _start_agent(list(agent), env, sys.stdout.buffer)
    daemon = supervisor.add(f"agent {node}", list(agent), env, Path(os.devnull), proc)
    fences = OrphanFences(events, job, f"the node supervisor on {node}") if events is not None else None
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    while not stopping:
        for line in supervisor.poll():
            print(f"resihp node supervisor ({node}): {line}", flush=True)
        if daemon.gave_up and fences is not None:
            for line in fences.poll({node}):
                print(f"resihp node supervisor ({node}): {line}", flush=True)
        time.sleep(POLL_S)
    if daemon.proc.poll() is None:
        daemon.proc.terminate()
        try:
            daemon.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m resihp.trainer_hooks.launch.node_supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True)
    p.add_argument("--run-dir", default="", help="the job's run directory, if this machine sees it")
    p.add_argument("--restart-budget", type=int, default=5)
    p.add_argument("agent", nargs=argparse.REMAINDER, help="-- the agent's command line")
    args = p.parse_args(argv)
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not agent:
        p.error("the agent's command line is missing (after --)")
    if args.restart_budget < 0:
        p.error(f"--restart-budget must be >= 0, got {args.restart_budget}")
    try:
        return run(agent, args.job, args.run_dir, args.restart_budget, os.environ)
    except ValueError as exc:  # no node name for this process (default_node says why)
        print(f"resihp node supervisor: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
