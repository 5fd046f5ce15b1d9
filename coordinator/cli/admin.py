"""``resihp admin``: inspect and steer a running job.

    resihp admin status | events | plan
    resihp admin inject slow --rank R --factor F      (F = 1 clears)
    resihp admin inject kill --rank R                 (SIGKILL, by the rank's agent)
    resihp admin exclude --rank R | readmit --rank R
    resihp admin policy [KEY=VALUE ...] | replan | drain

The coordinator is found through --coordinator HOST:PORT, RESIHP_COORDINATOR, or the
``coordinator.json`` of --run-dir (RESIHP_RUN_DIR); the token through --token,
RESIHP_TOKEN, --token-file or the run directory's ``token`` file. ``--json`` prints
machine-readable output. Exit status: 0 ok, 2 usage, 3 unreachable, 4 token refused,
5 request refused.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXIT_UNREACHABLE, EXIT_AUTH, EXIT_REFUSED = 3, 4, 5


def _common(top: bool) -> argparse.ArgumentParser:
    # The options are accepted before and after the subcommand. The subcommands' copies
    # default to "absent" (SUPPRESS): otherwise their None would overwrite a value given
    # before the subcommand (``resihp admin --run-dir D status``).
    d: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--coordinator", help="HOST:PORT of the coordinator", **d)
    common.add_argument("--run-dir", help="run directory holding coordinator.json and token", **d)
    common.add_argument("--token", help="job token (prefer RESIHP_TOKEN)", **d)
    common.add_argument("--token-file", **d)
    common.add_argument("--tls-ca", help="CA certificate: connect with TLS", **d)
    timeout: dict[str, Any] = {"default": 5.0} if top else d
    common.add_argument("--timeout", type=float, help="seconds per call", **timeout)
    common.add_argument("--json", action="store_true", help="machine-readable output", **d)
    return common


def _parser() -> argparse.ArgumentParser:
    top = _common(True)
    common = _common(False)
    p = argparse.ArgumentParser(prog="resihp admin", description=__doc__, parents=[top],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", parents=[common], help="job state, epoch and every rank")
    ev = sub.add_parser("events", parents=[common], help="the event log")
    ev.add_argument("--after", type=int, default=0, help="only events after this number")
    ev.add_argument("--limit", type=int, default=50)
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    sub.add_parser("plan", parents=[common], help="the current plan")
    inj = sub.add_parser("inject", parents=[common], help="inject a fault (tests and demos)")
    inj.add_argument("kind", choices=["slow", "kill"])
    inj.add_argument("--rank", type=int, required=True)
    inj.add_argument("--factor", type=float, default=2.0, help="slow: compute takes FACTOR times as long")
    for name, text in (("exclude", "take a device out of the plan"), ("readmit", "bring an excluded device back")):
        sp = sub.add_parser(name, parents=[common], help=text)
        sp.add_argument("--rank", type=int, required=True)
        sp.add_argument("--reason", default="")
    pol = sub.add_parser("policy", parents=[common], help="show or set detection policy")
    pol.add_argument("set", nargs="*", metavar="KEY=VALUE")
    rp = sub.add_parser("replan", parents=[common], help="force a re-plan now")
    rp.add_argument("--reason", default="")
    dr = sub.add_parser("drain", parents=[common], help="stop the job cleanly")
    dr.add_argument("--reason", default="")
    return p


def _target(args: argparse.Namespace) -> str:
    if args.coordinator:
        return str(args.coordinator)
    if os.environ.get("RESIHP_COORDINATOR"):
        return os.environ["RESIHP_COORDINATOR"]
    run_dir = args.run_dir or os.environ.get("RESIHP_RUN_DIR")
    if run_dir:
        info = Path(run_dir) / "coordinator.json"
        try:
            return str(json.loads(info.read_text())["grpc"])
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(_fail(EXIT_UNREACHABLE, f"cannot read {info}: {exc}; is the job running?")) from None
    raise SystemExit(_fail(2, "say where the coordinator is: --coordinator HOST:PORT, RESIHP_COORDINATOR or --run-dir"))


def _token(args: argparse.Namespace) -> str:
    from resihp.coordinator.protocol.auth import AuthError, resolve_token

    token_file = args.token_file
    run_dir = args.run_dir or os.environ.get("RESIHP_RUN_DIR")
    if not token_file and run_dir and (Path(run_dir) / "token").exists():
        token_file = str(Path(run_dir) / "token")
    try:
        return resolve_token(args.token, token_file)
    except AuthError as exc:
        raise SystemExit(_fail(EXIT_AUTH, str(exc))) from None


def _fail(code: int, message: str) -> int:
    print(f"resihp admin: {message}", file=sys.stderr)
    return code


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _print_event(e: dict[str, Any]) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(float(e.get("time", 0))))
    rest = {k: v for k, v in e.items() if k not in ("seq", "time", "job", "event", "reason", "plan")}
    detail = " ".join(f"{k}={v}" for k, v in rest.items())
    print(f"{e.get('seq'):>6} {when} {e.get('event', ''):<18} {e.get('reason', '')}" + (f"  [{detail}]" if detail else ""))


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import grpc

    from resihp.coordinator.protocol.auth import channel, metadata
    from resihp.proto import resihp_pb2 as pb
    from resihp.proto import resihp_pb2_grpc as pbg

    try:
        target, token = _target(args), _token(args)
    except SystemExit as exc:
        return int(exc.code or 2)
    chan = channel(target, args.tls_ca)
    stub = pbg.AdminStub(chan)
    md = metadata(token)

    def call(method: str, request: Any) -> Any:
        return getattr(stub, method)(request, metadata=md, timeout=args.timeout)

    try:
        if args.cmd == "status":
            r = call("Status", pb.StatusRequest())
            if args.json:
                print(json.dumps({
                    "job": r.job, "state": r.state, "state_reason": r.state_reason, "epoch": r.epoch,
                    "iteration": r.iteration, "world_size": r.world_size, "agents_connected": r.agents_connected,
                    "engine": r.engine, "policy": dict(r.policy), "uptime_s": r.uptime_s,
                    "planner_profile": r.planner_profile, "observe_only": r.observe_only, "model": r.model,
                    "ranks": [{"rank": x.rank, "node": x.node, "state": x.state, "iteration": x.iteration,
                               "step_s": x.step_s, "speed": x.speed, "last_seen_age_s": x.last_seen_age_s,
                               "role": x.role, "probe_ratio": x.probe_ratio, "kept": x.kept}
                              for x in r.ranks]}))
                return 0
            print(f"job {r.job}: {r.state} (epoch {r.epoch}, iteration {r.iteration}, {r.agents_connected} agents, "
                  f"engine {r.engine}) — {r.state_reason}")
            rows = [[x.rank, x.node or "-", x.role or "-", x.state, x.iteration, f"{x.step_s:.4f}", f"{x.speed:.2f}",
                     f"x{x.probe_ratio:.2f}" if x.probe_ratio > 0 else "-",
                     "-" if x.last_seen_age_s < 0 else f"{x.last_seen_age_s:.1f}"] for x in r.ranks]
            print(_table(rows, ["RANK", "NODE", "ROLE", "STATE", "ITER", "STEP_S", "SPEED", "PROBE", "SEEN_S_AGO"]))
            if r.observe_only:
                print(f"observe-only: {r.observe_only}")
            if r.model:
                print(f"model (as the trainers said): {r.model}")
            if r.planner_profile:
                print(f"planner profile: {r.planner_profile}")
            for x in r.ranks:
                if x.kept:  # the plan audit undid a re-plan for this rank's fault
                    print(f"rank {x.rank}: {x.kept}")
        elif args.cmd == "events":
            after = args.after
            while True:
                r = call("Events", pb.EventsRequest(after_seq=after, limit=args.limit))
                for text in r.events_json:
                    e = json.loads(text)
                    after = max(after, int(e.get("seq", 0)))
                    print(text) if args.json else _print_event(e)
                sys.stdout.flush()
                if not args.follow:
                    break
                time.sleep(1.0)
        elif args.cmd == "plan":
            r = call("GetPlan", pb.PlanRequest())
            plan = json.loads(r.plan_json) if r.plan_json else {}
            if args.json:
                print(json.dumps(plan))
                return 0
            print(f"epoch {r.epoch}, schedule {plan.get('schedule')}, spares {plan.get('spares')}")
            rows = []
            for i, rep in enumerate(plan.get("replicas", [])):
                for s, (group, layers) in enumerate(zip(rep["stages"], rep["layers"])):
                    rows.append([i, s, ",".join(map(str, group)), layers, rep["microbatches"] if s == 0 else ""])
            print(_table(rows, ["REPLICA", "STAGE", "TP_RANKS", "LAYERS", "MICROBATCHES"]))
            if plan.get("reason"):
                print(f"reason: {plan['reason']}")
        else:
            if args.cmd == "inject":
                r = call("Inject", pb.InjectRequest(kind=args.kind, rank=args.rank, factor=args.factor))
            elif args.cmd in ("exclude", "readmit"):
                r = call(args.cmd.capitalize(), pb.RankRequest(rank=args.rank, reason=args.reason))
            elif args.cmd == "policy":
                updates = {}
                for item in args.set:
                    k, sep, v = item.partition("=")
                    if not sep:
                        return _fail(2, f"policy settings are KEY=VALUE, got {item!r}")
                    updates[k] = v
                pr = call("Policy", pb.PolicyRequest(set=updates))
                if args.json:
                    print(json.dumps(dict(pr.policy)))
                else:
                    print(_table([[k, v] for k, v in sorted(pr.policy.items())], ["KEY", "VALUE"]))
                return 0
            elif args.cmd == "replan":
                r = call("Replan", pb.ReplanRequest(reason=args.reason))
            else:
                r = call("Drain", pb.DrainRequest(reason=args.reason))
            if args.json:
                print(json.dumps({"ok": r.ok, "message": r.message, "epoch": r.epoch, "seq": r.seq}))
            else:
                print(r.message)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return _fail(EXIT_UNREACHABLE, f"cannot reach the coordinator at {target} ({code.name}: {details}); "
                                           "is the job running and the address right?")
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return _fail(EXIT_AUTH, f"the coordinator at {target} refused the token: {details}")
        return _fail(EXIT_REFUSED, f"refused ({code.name}): {details}")
    finally:
        chan.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
