"""The ``resihp`` console script.

Each subcommand lives in its own module with its own argparse parser and a
``main(argv: list[str]) -> int``; this file only dispatches, importing lazily so that
``resihp detect`` never pays for torch or grpc.
"""
from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "detect": ("resihp.coordinator.cli.detect", "replay a trace through the detector; findings as JSON Lines"),
    "profile": ("resihp.coordinator.cli.profile", "measure the planner's profile (FLOP/s, link speed) from a trace"),
    "plan": ("resihp.coordinator.cli.plan", "search a new TP/PP/DP plan for a cluster, model and current plan"),
    "simulate": ("resihp.sim.cli", "simulate resilience policies at cluster scale"),
    "coordinator": ("resihp.coordinator.service.main", "run the job's coordinator service"),
    "agent": ("resihp.agent.main", "run a node's sidecar agent"),
    "admin": ("resihp.coordinator.cli.admin", "inspect and steer a running job"),
    "launch": ("resihp.trainer_hooks.launch.launcher", "start coordinator, agents and ranks under mpirun"),
    "demo": ("resihp.demo", "run the main job: a real training run with injected faults"),
    "report": ("resihp.report.cli", "render the summary and timeline of a run directory"),
    "examples": ("resihp.examples", "print where the example training scripts are, or copy them"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: resihp <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "run 'resihp <command> --help' for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("--version", "-V"):
        from resihp import __version__

        print(f"resihp {__version__}")
        return 0
    name = args[0]
    if name not in SUBCOMMANDS:
        print(f"resihp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"resihp: command {name!r} is not available in this build ({exc})", file=sys.stderr)
            return 2
        raise
    rc: int = module.main(args[1:])
    return rc


if __name__ == "__main__":
    sys.exit(main())
