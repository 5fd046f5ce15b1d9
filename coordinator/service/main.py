"""``resihp coordinator``: run a job's coordinator until SIGTERM / SIGINT.

Writes ``<run-dir>/coordinator.json`` ({grpc, metrics, pid, job}) once it serves, so
launchers and tests started with ``--port 0`` can read the bound ports back.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.protocol.auth import AuthError, resolve_token
from resihp.coordinator.service.config import ConfigError, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resihp coordinator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of CoordinatorConfig fields (CLI > env > file > defaults)")
    p.add_argument("--job", help="job name (env RESIHP_JOB)")
    p.add_argument("--run-dir", dest="run_dir", help="directory for journal, event log and coordinator.json")
    p.add_argument("--world-size", "-n", dest="world_size", type=int, help="number of trainer ranks")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--model", help="model preset name or model file (default gpt-tiny)")
    p.add_argument("--microbatches", type=int, help="global micro-batches per iteration")
    p.add_argument("--plan", dest="plan_file", help="initial plan JSON (instead of --tp/--pp/--dp)")
    p.add_argument("--device-flops", dest="device_flops", type=float,
                   help="planner: sustained FLOP/s of one healthy device (e.g. 2e10 for a CPU core)")
    p.add_argument("--cluster", dest="cluster_file", help="planner: cluster JSON with link speeds and device_flops")
    p.add_argument("--rank-nodes", dest="rank_nodes", help="node of every rank, comma-separated (node0,node0,...)")
    p.add_argument("--host", help="address to bind for agents and admin (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (0 = any free one; see coordinator.json)")
    p.add_argument("--metrics-host", dest="metrics_host")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="/metrics port (0 = any, -1 = off)")
    p.add_argument("--token", help="job token (prefer env RESIHP_TOKEN or --token-file)")
    p.add_argument("--token-file", dest="token_file", help="file holding the job token (mode 0600)")
    p.add_argument("--tls-cert", dest="tls_cert")
    p.add_argument("--tls-key", dest="tls_key")
    p.add_argument("--engine", choices=["auto", "real", "rules"], help="decision engine (default auto)")
    p.add_argument("--heartbeat-interval-s", dest="heartbeat_interval_s", type=float)
    p.add_argument("--heartbeat-timeout-s", dest="heartbeat_timeout_s", type=float)
    p.add_argument("--join-grace-s", dest="join_grace_s", type=float)
    p.add_argument("--agent-grace-s", dest="agent_grace_s", type=float,
                   help="seconds a lost agent is given to come back before its ranks' silence counts (default 30)")
    p.add_argument("--ack-timeout-s", dest="ack_timeout_s", type=float)
    p.add_argument("--apply-margin", dest="apply_margin", type=int, help="at least this many iterations ahead")
    p.add_argument("--apply-lead-s", dest="apply_lead_s", type=float,
                   help="and at least this many seconds ahead at the current pace (default 0.5)")
    p.add_argument("--no-auto-reconfigure", dest="auto_reconfigure", action="store_const", const=False)
    p.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE", help="engine policy override")
    p.add_argument("--insecure", action="store_true", help="run without a token (tests, single-user machines)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [coordinator] %(name)s: %(message)s")
    cli = {k: v for k, v in vars(args).items() if k not in ("config", "policy", "insecure", "log_level")}
    policy = {}
    for item in args.policy:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"resihp coordinator: --policy needs KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        policy[key] = value
    try:
        token = resolve_token(args.token, args.token_file)
        if not token and not args.insecure:
            print("resihp coordinator: no job token; pass --token-file / set RESIHP_TOKEN, or --insecure",
                  file=sys.stderr)
            return 2
        cli["token"] = token
        cfg = load_config(args.config, os.environ, cli)
        cfg.policy = {**cfg.policy, **policy}
        from resihp.coordinator.service.server import CoordinatorServer

        server = CoordinatorServer(cfg)
    except (ConfigError, SpecError, AuthError, ValueError, OSError) as exc:
        print(f"resihp coordinator: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"coordinator of job {cfg.job} on {server.address}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
