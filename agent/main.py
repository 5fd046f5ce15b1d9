"""``resihp agent``: run a node's sidecar agent until SIGTERM / SIGINT.

Configuration precedence: CLI > env (RESIHP_COORDINATOR, RESIHP_TOKEN, RESIHP_JOB,
RESIHP_NODE, RESIHP_AGENT_ADDR, RESIHP_RUN_DIR, RESIHP_AGENT_NICE) > defaults. Writes
``<run-dir>/agent-<node>.json`` with the bound hook address once it serves.

The node's name: ``--node``, else ``RESIHP_NODE``, else — for agents that ``mpirun`` starts
one per node, as ``resihp launch --hostfile`` does — the entry of ``RESIHP_NODE_NAMES``
(comma-separated, in hostfile order) at this process's MPI rank, else the host name.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

from resihp.coordinator.protocol.auth import AuthError, resolve_token


def default_node(env: Mapping[str, str]) -> str:
    """The node name when ``--node`` is not given (see the module docstring)."""
    if env.get("RESIHP_NODE"):
        return env["RESIHP_NODE"]
    names = [n for n in env.get("RESIHP_NODE_NAMES", "").split(",") if n]
    if names:
        rank = env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK", ""))
        if not rank.isdigit() or int(rank) >= len(names):
            raise ValueError(f"RESIHP_NODE_NAMES lists {len(names)} nodes but this agent's MPI rank is {rank or 'unset'}: "
                             "start one agent per node with 'mpirun --map-by ppr:1:node', or pass --node")
        return names[int(rank)]
    return socket.gethostname()


def main(argv: list[str]) -> int:
    env = os.environ
    try:
        node = default_node(env)
    except ValueError as exc:
        print(f"resihp agent: {exc}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="resihp agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node", default=node)
    p.add_argument("--job", default=env.get("RESIHP_JOB", "job"))
    p.add_argument("--coordinator", default=env.get("RESIHP_COORDINATOR"), help="host:port of the coordinator")
    p.add_argument("--token", default=None, help="job token (prefer env RESIHP_TOKEN)")
    p.add_argument("--token-file", default=None)
    p.add_argument("--tls-ca", default=env.get("RESIHP_TLS_CA", ""), help="CA file: use TLS to the coordinator")
    p.add_argument("--hook-address", default=env.get("RESIHP_AGENT_ADDR", "127.0.0.1:0"),
                   help="where hooks connect: 127.0.0.1:PORT, [::1]:PORT or unix:PATH")
    p.add_argument("--run-dir", default=env.get("RESIHP_RUN_DIR", ""))
    p.add_argument("--world-size", type=int, default=int(env.get("RESIHP_WORLD_SIZE", "0")))
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    p.add_argument("--gpu-sampler", choices=["nvml", "off", "fake"], default=env.get("RESIHP_GPU_SAMPLER", "nvml"))
    p.add_argument("--nvml-deadline-s", type=float, default=2.0, help="deadline of every NVML call")
    p.add_argument("--exit-when-ranks-done", action="store_true",
                   help="stop once every rank that said hello has exited")
    p.add_argument("--nice", type=int, default=int(env.get("RESIHP_AGENT_NICE", "0")),
                   help="CPU niceness to add (0..19): run in the training ranks' idle time (env RESIHP_AGENT_NICE)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [agent {args.node}] %(name)s: %(message)s")
    if not args.coordinator:
        print("resihp agent: --coordinator HOST:PORT (or RESIHP_COORDINATOR) is required", file=sys.stderr)
        return 2
    from resihp.agent.daemon import AgentConfig, AgentDaemon

    try:
        token = resolve_token(args.token, args.token_file)
        cfg = AgentConfig(node=args.node, job=args.job, coordinator=args.coordinator, token=token,
                          tls_ca=args.tls_ca, hook_address=args.hook_address, run_dir=args.run_dir,
                          world_size=args.world_size, sample_interval_s=args.sample_interval_s,
                          heartbeat_interval_s=args.heartbeat_interval_s, gpu_sampler=args.gpu_sampler,
                          nvml_deadline_s=args.nvml_deadline_s,
                          exit_when_ranks_done=args.exit_when_ranks_done, nice=args.nice)
        daemon = AgentDaemon(cfg)
    except (AuthError, ValueError, OSError) as exc:
        print(f"resihp agent: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stopped.set())
    daemon.start()
    print(f"agent {cfg.node} hooks on {daemon.hook_server.address}", flush=True)
    daemon.stopped.wait()
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
