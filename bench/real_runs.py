"""Real-run check of the detector (issue #25, item 6): healthy CPU jobs under ``resihp launch``
raise no fail-slow finding and no reconfiguration; a 1.3x throttle of one rank is found on
that rank.

Two layouts of ``examples/train_gpt.py`` (gpt-tiny, 8 micro-batches of 128 tokens):

- ``pp2dp2``: ``resihp launch -n 4 --pp 2 --dp 2 --nodes 2 -- python examples/train_gpt.py
  --tp 1 --pp 2 --dp 2 --steps 300``;
- ``tp2pp2dp2``: the same with 8 ranks, ``--tp 2``.

Each layout runs ``--runs`` healthy jobs of ``--steps`` steps; in the last one a busy
co-tenant process spins on one core for the middle third of the run. Then one job per layout
is throttled: ``resihp admin inject slow --rank R --factor 1.3`` at ``--slow-at``, and the
iterations from the throttle to the first finding naming rank R are counted. Every job uses
the coordinator's defaults (noise-adaptive detection), nothing tuned to this machine.

With ``--ramp-to F2 --ramp-at N`` the throttled job's rank is throttled further, to ``F2``, at
step ``N``: a slowdown that moves after its finding (a GPU heating up). The detector reports
the rank again with its new factor (docs/detector.md, "A slowdown that moves") and the
coordinator may re-plan for it; the JSON's runs say after how many iterations
(``ramp_detect_iters``), with which factor, and whether a re-plan followed.

``--cpu-per-rank auto`` starts every rank under a CPU quota (``resihp launch --cpu-per-rank``,
a fixed-speed "device" as in ``bench/e2e.py``). Measured once (2026-12-07, PP2×DP2, 2 healthy
runs and a throttled one): worse than shared cores, not better. The co-tenant run's DP ring of
stage 0 read 16× slow, and the 1.3× throttle on rank 2 was reported on rank 1. The quota's
throttled periods stall whole ops.

Prints a table, then one JSON line: ``real_false_findings`` (fail-slow findings and
reconfigurations over all healthy runs), ``real_slow_detect_iters`` (the worst throttled
run; null where it was not found), per-run details. ``bench/detect.py`` runs it unless
``--skip-real``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
LAYOUTS = {"pp2dp2": (1, 2, 2), "tp2pp2dp2": (2, 2, 2), "pp2dp2-long": (1, 2, 2), "pp2dp4": (1, 2, 4)}
# a stage-0 rank of replica 1 / a TP member of replica 1 / a stage-1 rank of replica 2
SLOW_RANK = {"pp2dp2": 2, "tp2pp2dp2": 5, "pp2dp2-long": 2, "pp2dp4": 5}
# pp2dp4: four ranks per stage, whose compute baselines anchor each other (docs/detector.md,
# "Slow from the start"); with --slow-at 0 the throttle lands before the first step
# pp2dp2-long: 96 micro-batches of 512 tokens, iterations of about 8 s on 2 cores: long enough
# for the detector's in-flight judging (docs/detector.md, "In flight"); not in the default set
EXAMPLE_ARGS = {"pp2dp2-long": ("--microbatches", "96", "--seq", "512")}
DEFAULT_LAYOUTS = ("pp2dp2", "tp2pp2dp2")


@dataclass
class RealRun:
    layout: str
    kind: str  # healthy | co-tenant | slow
    rc: int
    wall_s: float
    steps: int
    findings: list[dict[str, Any]] = field(default_factory=list)
    reconfigs: int = 0
    slow_at: int | None = None
    detect_iters: int | None = None
    in_flight: bool = False  # the throttle was found within an iteration (from the heartbeats' op states)
    found_ranks: list[int] = field(default_factory=list)
    run_dir: Path | None = None
    # --ramp-to: the step the second throttle began, the finding that reported the moved
    # slowdown (iterations after that step, its factor), and whether a re-plan answered it
    ramp_at: int | None = None
    ramp_detect_iters: int | None = None
    ramp_factor: float | None = None
    ramp_replanned: bool = False

    def row(self) -> str:
        kinds = ",".join(f"{f['kind']}:{f.get('ranks')}@{f.get('iteration')}" for f in self.findings) or "-"
        det = "" if self.kind != "slow" else f" detect {self.detect_iters} it" + (" (in flight)" if self.in_flight else "")
        if self.ramp_at is not None:
            det += (f"; throttled further at {self.ramp_at}: reported again after {self.ramp_detect_iters} it"
                    + (f" (x{self.ramp_factor:.2f}{', re-planned' if self.ramp_replanned else ''})"
                       if self.ramp_factor is not None else ""))
        return (f"{self.layout:10s} {self.kind:10s} rc {self.rc:3d} {self.steps:4d} steps {self.wall_s:6.1f} s "
                f"reconfigs {self.reconfigs}  findings {kinds}{det}")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written when the job ended
    return out


def _resihp(*args: str) -> list[str]:
    return [sys.executable, "-m", "resihp.cli", *args]


def _last_step(run: Path) -> int:
    steps = [int(r["step"]) for r in _jsonl(run / "progress.jsonl") if r.get("type") == "step"]
    return max(steps) if steps else -1


def run_job(root: Path, layout: str, kind: str, steps: int, slow_at: int, factor: float,
            timeout_s: float, clock: str = "wall", ramp: tuple[int, float] | None = None,
            cpu_per_rank: str = "") -> RealRun:
    tp, pp, dp = LAYOUTS[layout]
    n = tp * pp * dp
    run = root / f"{layout}-{kind}-{time.monotonic_ns()}"
    run.mkdir(parents=True)
    quota = [f"--cpu-per-rank={cpu_per_rank}"] if cpu_per_rank else []
    cmd = _resihp("launch", "-n", str(n), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--nodes", "2",
                  "--run-dir", str(run), *quota, "--", sys.executable, str(EXAMPLE), "--tp", str(tp), "--pp", str(pp),
                  "--dp", str(dp), "--steps", str(steps), "--log-every", "1000000", "--compute-clock", clock,
                  *EXAMPLE_ARGS.get(layout, ()))
    t0 = time.monotonic()
    env = dict(os.environ)
    injected: int | None = None
    if kind == "slow" and slow_at == 0:  # slow from the first step: the hooks' own throttle, no admin call
        env["RESIHP_THROTTLE"] = f"{SLOW_RANK[layout]}:{factor}@0"
        injected = 0
    with open(run / "launch.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        tenant: subprocess.Popen[bytes] | None = None
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    proc.terminate()
                    break
                step = _last_step(run)
                if kind == "co-tenant" and tenant is None and step >= steps // 3:
                    tenant = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                if tenant is not None and step >= 2 * steps // 3 and tenant.poll() is None:
                    tenant.kill()
                if kind == "slow" and injected is None and step + 1 >= slow_at:
                    subprocess.run(_resihp("admin", "inject", "slow", "--rank", str(SLOW_RANK[layout]), "--factor",
                                           str(factor), "--run-dir", str(run)), capture_output=True, timeout=60)
                    injected = _last_step(run) + 1  # the first step the throttle can slow
                if kind == "slow" and ramp is not None and injected is not None and step + 1 >= ramp[0]:
                    subprocess.run(_resihp("admin", "inject", "slow", "--rank", str(SLOW_RANK[layout]), "--factor",
                                           str(ramp[1]), "--run-dir", str(run)), capture_output=True, timeout=60)
                    ramp = None
                time.sleep(0.2)
            proc.wait(60)
        finally:
            if tenant is not None and tenant.poll() is None:
                tenant.kill()
            if proc.poll() is None:
                proc.kill()
    events = _jsonl(run / "events.jsonl")
    findings = [e for e in events if e.get("event") == "finding" and e.get("kind") in ("fail-slow", "fail-stop")]
    reconfigs = sum(1 for e in events if e.get("event") == "command" and e.get("kind") == "reconfigure")
    out = RealRun(layout, kind, proc.returncode, time.monotonic() - t0, _last_step(run) + 1, findings, reconfigs,
                  run_dir=run)
    if kind == "slow" and injected is not None:
        # the first iteration the rank ran throttled, as the rank logged it (the command takes
        # a step or two to arrive); the step after the admin call where the log lacks it. A
        # second such line is --ramp-to's throttle
        starts = [int(x) for x in re.findall(rf"rank {SLOW_RANK[layout]} compute throttled to \S+ speed from iteration "
                                             rf"(\d+)", (run / "launch.log").read_text(errors="replace"))]
        injected = starts[0] if starts else injected
        out.slow_at = injected
        after = [f for f in findings if f["kind"] == "fail-slow" and int(f.get("iteration", -1)) >= injected]
        hit = next((f for f in after if SLOW_RANK[layout] in f.get("ranks", [])), None)
        out.found_ranks = sorted({r for f in after for r in f.get("ranks", [])})
        out.detect_iters = int(hit["iteration"]) - injected + 1 if hit is not None else None
        out.in_flight = hit is not None and "in flight" in str(hit.get("reason", ""))
        if len(starts) > 1:
            _ramp_result(out, events, SLOW_RANK[layout], starts[1])
    return out


def _ramp_result(out: RealRun, events: list[dict[str, Any]], rank: int, began: int) -> None:
    """The finding that reported ``rank``'s slowdown moved, once it was throttled further at
    step ``began``, and whether a reconfiguration was commanded for it."""
    out.ramp_at = began
    moved = next((e for e in events if e.get("event") == "finding" and e.get("kind") in ("fail-slow", "degraded")
                  and rank in e.get("ranks", []) and int(e.get("iteration", -1)) >= began
                  and "reported_factor" in (e.get("evidence") or {})), None)
    if moved is None:
        return
    out.ramp_detect_iters = int(moved["iteration"]) - began + 1
    out.ramp_factor = float(moved["factor"])
    out.ramp_replanned = any(e.get("event") == "command" and e.get("kind") == "reconfigure"
                             and int(e.get("seq", -1)) > int(moved.get("seq", 0)) for e in events)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="healthy runs per layout (the last with a co-tenant)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"of {sorted(LAYOUTS)}")
    ap.add_argument("--slow-at", type=int, default=60, help="step of the throttle in the slow runs")
    ap.add_argument("--slow-steps", type=int, default=120, help="steps of a throttled run")
    ap.add_argument("--factor", type=float, default=1.3)
    ap.add_argument("--ramp-to", type=float, default=None,
                    help="throttle the slow run's rank further, to this factor, at --ramp-at (a slowdown that moves)")
    ap.add_argument("--ramp-at", type=int, default=None, help="step of the second throttle (with --ramp-to)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per job")
    ap.add_argument("--keep", default="", help="keep the run directories here (default: a temporary one)")
    ap.add_argument("--compute-clock", default="wall", choices=("wall", "cpu", "auto"),
                    help="the example's --compute-clock (cpu: compute ops in CPU time)")
    ap.add_argument("--cpu-per-rank", default="",
                    help="resihp launch --cpu-per-rank (e.g. auto: a CPU quota per rank, a fixed-speed device as a GPU "
                         "is; default: the ranks share the cores)")
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    ramp = None
    if args.ramp_to is not None or args.ramp_at is not None:
        if args.ramp_to is None or args.ramp_at is None or not args.slow_at < args.ramp_at < args.slow_steps:
            ap.error("--ramp-to and --ramp-at go together, with --slow-at < --ramp-at < --slow-steps")
        ramp = (args.ramp_at, args.ramp_to)
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; known: {sorted(LAYOUTS)}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # run directories of runs that went as they should are removed; the others stay for a look
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="resihp-real-"))
    runs: list[RealRun] = []
    for layout in layouts:
        for i in range(args.runs):
            kind = "co-tenant" if i == args.runs - 1 else "healthy"
            runs.append(run_job(root, layout, kind, args.steps, 0, 1.0, args.timeout_s, args.compute_clock,
                                cpu_per_rank=args.cpu_per_rank))
            print(runs[-1].row(), flush=True)
        runs.append(run_job(root, layout, "slow", args.slow_steps, args.slow_at, args.factor, args.timeout_s,
                            args.compute_clock, ramp, args.cpu_per_rank))
        print(runs[-1].row(), flush=True)
    kept = [r.run_dir for r in runs if r.rc != 0 or (r.kind != "slow" and (r.findings or r.reconfigs))
            or (r.kind == "slow" and (r.detect_iters is None or r.found_ranks != [SLOW_RANK[r.layout]]))]
    if not args.keep:
        for r in runs:
            if r.run_dir is not None and r.run_dir not in kept:
                shutil.rmtree(r.run_dir, ignore_errors=True)
    for d in kept:
        print(f"kept for a look: {d}")
    healthy = [r for r in runs if r.kind != "slow"]
    slow = [r for r in runs if r.kind == "slow"]
    false = sum(len([f for f in r.findings if f["kind"] == "fail-slow"]) + r.reconfigs for r in healthy)
    iters = [r.detect_iters for r in slow]
    worst = None if not iters or any(i is None for i in iters) else max(i for i in iters if i is not None)
    print(f"\nhealthy runs {len(healthy)} (failed {sum(r.rc != 0 for r in healthy)}), false fail-slow findings + "
          f"reconfigurations {false}; throttled x{args.factor}: detect iterations {iters}, ranks "
          f"{[r.found_ranks for r in slow]}")
    print(json.dumps({
        "real_false_findings": false, "real_slow_detect_iters": worst,
        "real_healthy_runs": len(healthy), "real_runs_failed": sum(r.rc != 0 for r in runs),
        "real_slow_localised": all(r.found_ranks == [SLOW_RANK[r.layout]] for r in slow) if slow else None,
        "runs": [{"layout": r.layout, "kind": r.kind, "rc": r.rc, "steps": r.steps, "wall_s": round(r.wall_s, 1),
                  "findings": [[f["kind"], f.get("ranks"), f.get("iteration")] for f in r.findings],
                  "reconfigs": r.reconfigs, "detect_iters": r.detect_iters, "in_flight": r.in_flight,
                  **({"ramp_at": r.ramp_at, "ramp_detect_iters": r.ramp_detect_iters, "ramp_factor": r.ramp_factor,
                      "ramp_replanned": r.ramp_replanned} if r.ramp_at is not None else {})} for r in runs],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
