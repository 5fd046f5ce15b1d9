"""``resihp simulate``: compare resilience policies on a failure scenario.

    resihp simulate --scenario NAME|FILE --gpus N --model NAME --hours H [--plot FILE] [--seed S]
                    [--policies a,b,...] [--save-trace FILE]

Prints one table row per policy (average tokens/s, goodput relative to failure-free, share
of the upper bound, time degraded and down, reconfigurations, restarts) and optionally draws
throughput over time. A FILE scenario replays a failure trace (docs/failure-trace-format.md).
Exit codes: 0 ok, 2 bad input (message says what to fix).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from resihp.coordinator.model.spec import PRESETS, SpecError
from resihp.sim import policies as policy_registry
from resihp.sim import scenarios
from resihp.sim.failures import FailureTraceError, dump_trace
from resihp.sim.runner import compare, plot, table


def build_parser() -> argparse.ArgumentParser:
    assert __doc__ is not None
    p = argparse.ArgumentParser(prog="resihp simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True,
                   help=f"a scenario name ({', '.join(scenarios.SCENARIOS)}) or a failure-trace file")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the job (default: the scenario's)")
    p.add_argument("--model", default="llama2-70b", help=f"model preset ({', '.join(sorted(PRESETS))})")
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default: the scenario's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure process")
    p.add_argument("--plot", default=None, help="write a throughput-over-time PNG here")
    p.add_argument("--policies", default=None, help=f"comma-separated subset of {', '.join(policy_registry.names())}")
    p.add_argument("--save-trace", default=None, help="write the faults that were simulated as a failure trace")
    p.add_argument("--layout", default="tuned", choices=("tuned", "paper"),
                   help="the job's initial layout: the fastest uniform one (tuned) or the paper's shapes")
    p.add_argument("--documents", type=int, default=1,
                   help="packed documents per micro-batch (1: one fills it); more let resihp cut DP shares "
                        "by the document (bench/simulate.py uses 4)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if os.path.exists(args.scenario):
            sc = scenarios.scenario_from_file(args.scenario)
        else:
            sc = scenarios.get(args.scenario)
        gpus = args.gpus if args.gpus is not None else sc.default_gpus
        hours = args.hours if args.hours is not None else sc.default_hours
        if gpus <= 0 or not hours > 0:
            raise SpecError(f"--gpus must be > 0 and --hours > 0, got {gpus} and {hours}")
        job = scenarios.job_for(args.model, gpus, layout=args.layout, documents=args.documents)
        names = None
        if args.policies:
            names = [n.strip() for n in args.policies.split(",") if n.strip()]
            known = policy_registry.known()
            unknown = [n for n in names if n not in known]
            if unknown:
                raise SpecError(f"unknown policies {unknown}; known: {', '.join(known)}")
        cmp = compare(sc, job, hours, args.seed, names)
    except (SpecError, FailureTraceError, ValueError, OSError) as exc:
        print(f"resihp simulate: {exc}", file=sys.stderr)
        return 2
    print(table(cmp))
    if args.plot:
        plot(cmp, args.plot)
        print(f"plot written to {args.plot}")
    if args.save_trace:
        with open(args.save_trace, "w", encoding="utf-8") as out:
            dump_trace(cmp.faults, out, job.world_size, job.gpus_per_node, f"{sc.name} seed {args.seed}")
        print(f"failure trace written to {args.save_trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
