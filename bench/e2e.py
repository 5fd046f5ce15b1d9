"""End-to-end: the same faulted training job run three ways — static, checkpoint-restart, resihp.

    python bench/e2e.py [--steps 70 --slow-at 14 --kill-at 42 --checkpoint-every 5 --out DIR --quick]
                        [--start best,fixed]

The job is `resihp demo`'s: 8 ranks of gpt-tiny on CPU under `resihp launch`; rank 2
computes 2x slower from step --slow-at, rank 5 (or, if the re-plan left it idle, a rank that
holds state) is SIGKILLed at --kill-at.

Starts (``--start``): ``best`` — every policy starts at the best healthy layout of the 8
ranks, found once by the layout profile `resihp launch --layout auto` runs (each healthy
layout timed on the ranks; trainer_hooks/runtime/autolayout.py), so no policy gains by
leaving a poor start; ``fixed`` — the TP2 x PP2 x DP2 start of earlier runs (TP2 is ~2x
slower than TP1 here: a re-plan that leaves it wins a better layout, not resilience). The
headline numbers are the best start's; the fixed start's follow as a second table and under
``fixed_start`` in the JSON.

- resihp: `resihp demo` itself (live detection, re-plan, live reconfiguration, fail-stop
  recovery) via ``resihp.demo.run_job``;
- static and restart: bench/e2e_restart.py (relaunch from checkpoints; see its docstring for
  the policies and the directory layout).

Then a single-process fault-free reference run gives the loss every policy must match. All
three run in this one invocation (the machine is noisy: ratios are taken within one run).
Prints a table, then ONE line of JSON. Numbers:

- tokens/s whole run: every step's tokens counted once / (end of the last step − start of the
  first), so downtime, relaunches and re-done steps all count against a policy;
- tokens/s in the slow phase: the rate while rank 2 is (or would be) slow, up to the kill —
  static: from the slow injection (``summarize``'s ``fail-slow`` phase); restart: from its
  relaunch; resihp: from its first planned reconfiguration, every later re-plan and its
  downtime included. The time before the window's first step is excluded (as ``summarize``
  counts a phase);
- resihp_vs_static: the two slow-phase rates; ``resihp_vs_static_normalized`` divides each by
  its own run's healthy-start rate first (the runs happen minutes apart on a shared machine);
  ``resihp_vs_static_whole_run``: the whole-run rates (static relaunches from its checkpoint
  after the kill), as ``resihp_vs_restart`` is;
- throughput_retained_vs_bound: resihp's slow-phase rate / (its healthy rate x the healthy
  compute fraction, (n − k + k/f) / n for k ranks f-times slow out of n). From the best start
  the healthy rate is the best healthy layout's, so the value is <= 1 up to noise:
  ``throughput_retained_noise`` is its standard error from the per-step rates of the two
  windows (and a throttled rank's sleeps free CPU for the others on this shared box, which
  a GPU does not: see docs). From the fixed start it can exceed 1 (a better layout);
- detect_latency_s_*: from the coordinator's ``inject`` event (it relayed the fault) to its
  first matching ``finding``: both on the coordinator's clock.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_restart import Injection, RestartConfig, RestartRun, run_policy, startup_failed  # noqa: E402

from resihp.demo import _parser as demo_parser  # noqa: E402
from resihp.demo import run_job, run_reference  # noqa: E402

RANKS = 8


# --- pure metrics -------------------------------------------------------------------------

def step_lines(lines: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in lines if r.get("type") == "step"]


def whole_run(lines: Iterable[Mapping[str, Any]]) -> dict[str, float | int | None]:
    """Tokens of every step counted once (the last line of a step wins) over the wall time from
    the start of the first step to the end of the last: relaunches and re-done steps count."""
    rows = step_lines(lines)
    if not rows:
        return {"steps": 0, "tokens": 0, "seconds": None, "tokens_per_s": None, "reruns": 0, "end": None}
    final: dict[int, Mapping[str, Any]] = {}
    for r in rows:
        final[int(r["step"])] = r
    start = min(float(r["time"]) - float(r.get("step_s", 0.0)) for r in rows)
    end = max(float(r["time"]) for r in rows)
    tokens = sum(int(r["tokens"]) for r in final.values())
    secs = end - start
    return {"steps": len(final), "tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs if secs > 0 else None, "reruns": len(rows) - len(final), "end": end}


def window_rate(lines: Iterable[Mapping[str, Any]], t_from: float, t_to: float) -> float | None:
    """Steady tokens/s of the step lines that ended in (t_from, t_to], as ``summarize`` counts a
    phase: the tokens after the first such step over (end of last − end of first)."""
    rows = sorted((r for r in step_lines(lines) if t_from < float(r["time"]) <= t_to), key=lambda r: float(r["time"]))
    if len(rows) < 2 or float(rows[-1]["time"]) <= float(rows[0]["time"]):
        return None
    return sum(int(r["tokens"]) for r in rows[1:]) / (float(rows[-1]["time"]) - float(rows[0]["time"]))


def rate_relative_se(lines: Iterable[Mapping[str, Any]], t_from: float, t_to: float) -> float | None:
    """The relative standard error of ``window_rate`` over (t_from, t_to]: the spread of the
    window's per-step rates (tokens / time since the previous step) over sqrt(steps)."""
    rows = sorted((r for r in step_lines(lines) if t_from < float(r["time"]) <= t_to), key=lambda r: float(r["time"]))
    rates = [int(b["tokens"]) / (float(b["time"]) - float(a["time"])) for a, b in zip(rows, rows[1:])
             if float(b["time"]) > float(a["time"])]
    if len(rates) < 3:
        return None
    return statistics.stdev(rates) / statistics.fmean(rates) / math.sqrt(len(rates))


def itp_errors(iterations: list[int], predicted: list[float], observed: list[float], changes: list[int],
               healthy_until: int | None) -> dict[str, float | int | None]:
    """The iteration predictor's mean relative error |predicted − observed| / observed: on the
    healthy start (iterations before ``healthy_until``), and after each plan change k over
    iterations [k + 3, k + 10) and [k + 10, k + 20) (the issue's "within 3" and "within 10"),
    the worst change's. An iteration the predictor did not price counts as not priced."""
    err = {i: abs(p - o) / o for i, p, o in zip(iterations, predicted, observed) if o > 0}

    def mean(lo: int, hi: int) -> float | None:
        vals = [err[i] for i in range(lo, hi) if i in err]
        return statistics.fmean(vals) if vals else None

    after3 = [mean(k + 3, k + 10) for k in changes]
    after10 = [mean(k + 10, k + 20) for k in changes]
    return {"itp_error_healthy": mean(0, healthy_until) if healthy_until is not None else None,
            "post_replan_itp_error_3": max((v for v in after3 if v is not None), default=None),
            "post_replan_itp_error_10": max((v for v in after10 if v is not None), default=None),
            "post_replan_unpriced_3": sum(1 for k in changes for i in range(k + 3, k + 10) if i not in err)}


def trace_itp_errors(run: Path, slow_step: int) -> dict[str, float | int | None]:
    """``itp_errors`` of a run: the detector replayed over its trace (resihp report's predicted
    curve); plan changes from the trace's plan records."""
    from resihp.report.trace import predicted_times

    series = predicted_times(run / "trace.jsonl")
    changes = [int(r["iteration"]) for r in read_jsonl(run / "trace.jsonl") if r.get("type") == "plan"]
    return itp_errors(series.iterations, series.predicted_s, series.observed_s, changes, slow_step)


def healthy_fraction(ranks: int, slow_ranks: int, factor: float) -> float:
    """The share of the healthy compute left when ``slow_ranks`` of ``ranks`` run ``factor``x slower."""
    if not 0 <= slow_ranks <= ranks or ranks < 1 or factor < 1:
        raise ValueError(f"healthy_fraction: need 0 <= slow_ranks <= ranks, ranks >= 1, factor >= 1; got "
                         f"{slow_ranks}, {ranks}, {factor}")
    return (ranks - slow_ranks + slow_ranks / factor) / ranks


def retained_vs_bound(adapted: float | None, healthy: float | None, fraction: float) -> float | None:
    if adapted is None or not healthy:
        return None
    return adapted / (healthy * fraction)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


FINDING_OF = {"slow": "fail-slow", "kill": "fail-stop"}


def detection_latencies(events: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """Seconds from the coordinator's ``inject`` event (when it relayed the fault to the rank's
    agent) to its first ``finding`` of the matching kind naming that rank (or no rank), per
    kind of the first injection of each kind. Both times are the coordinator's, so a driver's
    own delay in making the admin call does not count either way."""
    evs = sorted(events, key=lambda e: float(e.get("time", 0.0)))
    out: dict[str, float | None] = {}
    for inj in (e for e in evs if e.get("event") == "inject"):
        kind = str(inj.get("kind"))
        if kind not in FINDING_OF or kind in out:
            continue
        t, rank = float(inj["time"]), inj.get("rank")
        hit = next((f for f in evs if f.get("event") == "finding" and f.get("kind") == FINDING_OF[kind]
                    and float(f["time"]) >= t and (rank in f.get("ranks", []) or not f.get("ranks"))), None)
        out[kind] = float(hit["time"]) - t if hit is not None else None
    return out


def adapted_start(lines: Iterable[Mapping[str, Any]], slow_t: float | None) -> float | None:
    """When resihp's first planned reconfiguration after the fail-slow injection happened."""
    return min((float(r["time"]) for r in lines if r.get("type") == "reconfig" and r.get("kind") == "planned"
                and (slow_t is None or float(r["time"]) > slow_t)), default=None)


def adapted_window(lines: Iterable[Mapping[str, Any]], slow_t: float | None,
                   kill_t: float | None) -> tuple[float | None, bool]:
    """(tokens/s, adapted before the kill) of resihp's adapted window: from its first planned
    reconfiguration after the fail-slow injection to the kill, every later re-plan and its
    downtime included (a planner that keeps switching pays for it here)."""
    rows = list(lines)
    end = kill_t if kill_t is not None else float("inf")
    first = adapted_start(rows, slow_t)
    if first is None:
        return None, False
    return window_rate(rows, first, end), first < end


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for text in path.read_text(errors="replace").splitlines():
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


# --- the three runs -----------------------------------------------------------------------

def _injection_time(injections: list[dict[str, Any]], kind: str, first: bool = True) -> float | None:
    times = [float(i["time"]) for i in injections if i.get("kind") == kind and i.get("ok", True)]
    return (min(times) if first else max(times)) if times else None


def _stop_launch_child(run: Path) -> None:
    """SIGTERM the `resihp launch` that ``run_job`` started for ``run`` (it then returns)."""
    import psutil

    for child in psutil.Process().children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "launch" in cmd and str(run) in cmd:
            child.terminate()


def best_healthy_layout(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The layout profile of `resihp launch --layout auto`, run once on the demo job's 8 ranks
    (a profile-only start of the example: every healthy layout timed); its record."""
    from resihp.trainer_hooks.launch import layout_profile as lp
    from resihp.trainer_hooks.launch.launcher import find_mpirun, mpirun_command
    from resihp.trainer_hooks.launch.rank_env import loopback_ifname

    run = out / "layout-profile"
    run.mkdir(parents=True, exist_ok=True)
    demo = demo_parser().parse_args([])
    env, names = lp.profile_env(os.environ, RANKS, RANKS, demo.microbatches,
                                {"PMIX_MCA_gds": "hash", "GLOO_SOCKET_IFNAME": loopback_ifname()})
    cmd = [sys.executable, str(demo.script), "--layout", "auto", "--seq", str(demo.seq), "--microbatches",
           str(demo.microbatches), "--seed", str(demo.seed), "--threads", "1"]
    if a.cpu_per_rank:  # the profile times the layouts on the same "devices" the policies run on
        from resihp.trainer_hooks.launch.launcher import cpu_per_rank, cpu_share_command

        cmd = cpu_share_command(cpu_per_rank(a.cpu_per_rank, RANKS, sys.exit), f"resihp-e2e-{os.getpid()}", cmd)
    try:
        return lp.run_profile(lambda n: mpirun_command(find_mpirun(), RANKS, n, cmd, mca={"btl": "self,sm"}), env,
                              names, run)
    finally:
        from resihp.trainer_hooks.launch.cpu_share import release

        release(f"resihp-e2e-{os.getpid()}")


def run_resihp(root: Path, a: argparse.Namespace, layout: str, attempts: int = 3,
               startup_s: float = 300.0) -> dict[str, Any]:
    """`resihp demo`'s job via ``run_job``; an attempt whose ranks fail to start (before any
    step: an Open MPI start-up failure on this shared machine, not a resihp decision) is
    stopped and made again in a fresh directory."""
    from resihp.coordinator.planner.autolayout import Layout

    lay = Layout.parse(layout)
    args = demo_parser().parse_args(["--steps", str(a.steps), "--slow-at", str(a.slow_at), "--kill-at",
                                     str(a.kill_at), "--quiet", "--no-reference", "--run-dir", str(root),
                                     "--tp", str(lay.tp), "--pp", str(lay.pp), "--dp", str(lay.dp)]
                                    + ([f"--cpu-per-rank={a.cpu_per_rank}"] if a.cpu_per_rank else []))
    failures = 0
    for _ in range(attempts):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(demo=run_job(args, root)), daemon=True)
        worker.start()
        failed = False
        while worker.is_alive():
            worker.join(0.5)
            if not failed and not step_lines(read_jsonl(root / "progress.jsonl")) and (
                    startup_failed(root / "launch.log") or time.time() - t0 > startup_s):
                failed = True
                _stop_launch_child(root)
        if failed or "demo" not in box:
            failures += 1
            print(f"  resihp: the ranks failed to start (see {root}/launch.log); again", flush=True)
            continue
        demo = box["demo"]
        (root / "demo.json").write_text(json.dumps(demo, indent=1))
        return {"policy": "resihp", "wall_s": time.time() - t0, "launched": t0, "restarts": 0,
                "startup_failures": failures, "finished": demo["scenario"]["launch_rc"] == 0,
                "injections": demo["injections"]}
    raise RuntimeError(f"resihp: the job failed to start {attempts} times; see {root}/launch.log")


def run_reference_into(root: Path, a: argparse.Namespace) -> None:
    args = demo_parser().parse_args(["--steps", str(a.steps), "--quiet"])
    run_reference(args, root)


def _summary(root: Path) -> dict[str, Any] | None:
    from resihp.report.summary import summarize

    try:
        return summarize(root).to_dict()
    except Exception as exc:  # noqa: BLE001 - a broken run is reported, not fatal to the others
        print(f"  ({root}: no summary: {exc})", file=sys.stderr)
        return None


def policy_numbers(policy: str, root: Path, info: dict[str, Any]) -> dict[str, Any]:
    lines = read_jsonl(root / "progress.jsonl")
    whole = whole_run(lines)
    summ = _summary(root) or {}
    rates = summ.get("tokens_per_s", {})
    inj = info.get("injections", [])
    slow_t = _injection_time(inj, "slow")
    kill_t = _injection_time(inj, "kill")
    adapted_before_kill = None
    noise: dict[str, float | None] = {}
    if policy == "resihp":
        slow_phase, adapted_before_kill = adapted_window(lines, slow_t, kill_t)
        first = adapted_start(lines, slow_t)
        noise = {"healthy_rate_rel_se": rate_relative_se(lines, 0.0, slow_t if slow_t is not None else math.inf),
                 "adapted_rate_rel_se": None if first is None else rate_relative_se(
                     lines, first, kill_t if kill_t is not None else math.inf)}
    elif policy == "static":
        slow_phase = rates.get("fail-slow")
    else:  # restart: the relaunch after the fail-slow, until the kill
        segs = info.get("segments", [])
        after = [s for s in segs[1:] if slow_t is not None and s["launched"] > slow_t]
        t_from = after[0]["launched"] if after else float("inf")
        slow_phase = window_rate(lines, t_from, kill_t if kill_t is not None else float("inf"))
    end, launched = whole["end"], info.get("launched")
    detect = detection_latencies(read_jsonl(root / "events.jsonl"))
    return {"policy": policy, "tokens_per_s": whole["tokens_per_s"], "slow_phase_tokens_per_s": slow_phase,
            "healthy_tokens_per_s": rates.get("healthy"), "restarts": info.get("restarts", 0),
            "startup_failures": info.get("startup_failures", 0),
            "wall_s": whole["seconds"], "driver_wall_s": info.get("wall_s"),
            "launch_to_end_s": end - launched if end is not None and launched is not None else None,
            "steps": whole["steps"],
            "reruns": whole["reruns"], "finished": info.get("finished"),
            "loss_delta": summ.get("loss_delta_vs_reference"),
            "detect_latency_s_slow": detect.get("slow"), "detect_latency_s_stop": detect.get("kill"),
            "report_detect_latency_s": [summ.get("detect_latency_s_slow"), summ.get("detect_latency_s_stop")],
            "adapted_before_kill": adapted_before_kill, **noise,
            "downtime_s": summ.get("downtime_s"), "phases": rates,
            "restart_gaps": restart_gaps(info.get("segments", []))}


def restart_gaps(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per restart: the wall time between the last step trained before it and the first one
    after it, and how many steps the relaunch trained again (back to its checkpoint)."""
    trained = [s for s in segments if s.get("first_step_end") is not None]
    out = []
    for prev, nxt in zip(trained, trained[1:]):
        out.append({"after_step": prev["last_step"], "reason": prev["end_reason"],
                    "lost_s": nxt["first_step_end"] - prev["last_step_end"],
                    "redone": max(0, prev["last_step"] + 1 - nxt["resumed_at"])})
    return out


def _restart_info(run: RestartRun, t0: float) -> dict[str, Any]:
    from dataclasses import asdict

    startup = sum(1 for s in run.segments if s.end_reason == "start-up failure")
    return {"policy": run.policy, "wall_s": time.time() - t0, "launched": t0, "startup_failures": startup,
            "restarts": sum(1 for s in run.segments if s.end_reason not in ("finished", "start-up failure")),
            "finished": run.finished, "injections": [i for i in run.injections if i.get("ok")],
            "segments": [asdict(s) for s in run.segments]}


def _fmt(v: Any, nd: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"
    return str(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'policy':<8} {'tok/s run':>10} {'healthy':>8} {'slow phase':>10} {'slow/healthy':>12} {'restarts':>8} "
            f"{'wall s':>7} {'+launch':>7} {'reruns':>6} {'loss delta':>10}  finished")
    print(head)
    print("-" * len(head))
    for r in rows:
        kept = ratio(r["slow_phase_tokens_per_s"], r["healthy_tokens_per_s"])
        print(f"{r['policy']:<8} {_fmt(r['tokens_per_s']):>10} {_fmt(r['healthy_tokens_per_s']):>8} "
              f"{_fmt(r['slow_phase_tokens_per_s']):>10} {_fmt(kept, 2):>12} "
              f"{r['restarts']:>8} {_fmt(r['wall_s'], 1):>7} {_fmt(r['launch_to_end_s'], 1):>7} {r['reruns']:>6} "
              f"{_fmt(r['loss_delta']):>10}  {r['finished']}")
    print("tok/s run: every step once, first step start -> last step end (= wall s; +launch: from the first launch)\n"
          "slow phase: resihp after its adaptation, static throttled, restart after its relaunch (steady, no downtime)")
    for r in rows:
        for gap in r.get("restart_gaps", []):
            print(f"  {r['policy']}: restart after step {gap['after_step']} ({gap['reason']}): {gap['lost_s']:.1f} s "
                  f"between trained steps (detection + teardown + relaunch), {gap['redone']} step(s) re-done")


START_FIXED = "TP2xPP2xDP2"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--slow-at", type=int, default=14)
    ap.add_argument("--kill-at", type=int, default=42)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--out", default="", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 36 steps, slow at 5, kill at 28")
    ap.add_argument("--policies", default="resihp,static,restart", help="which to run (comma-separated)")
    ap.add_argument("--start", default="best,fixed",
                    help="which starts to run, comma-separated: best (the best healthy layout, profiled) and/or "
                         f"fixed ({START_FIXED})")
    ap.add_argument("--devices", choices=("dedicated", "shared"), default="",
                    help="dedicated: each rank a fixed CPU quota of this machine's CPUs / 8 (resihp launch "
                         "--cpu-per-rank auto), so a rank is a device of its own, as a GPU is; shared: the ranks "
                         "share the CPUs freely. Default: dedicated where a CPU cgroup is writable (root)")
    ap.add_argument("--recompute", default="", metavar="DIR",
                    help="run nothing: recompute the tables and JSON from the e2e.json of an earlier --out DIR")
    a = ap.parse_args(argv)
    if a.recompute:
        saved = json.loads((Path(a.recompute) / "e2e.json").read_text())
        for k in ("steps", "slow_at", "kill_at", "checkpoint_every", "devices"):
            setattr(a, k, saved["result"].get(k, ""))
        return report(Path(a.recompute).resolve(), a, saved["starts"], saved.get("profile"))
    if a.quick:
        a.steps, a.slow_at, a.kill_at = 36, 5, 28
    if not a.devices:
        from resihp.trainer_hooks.launch.cpu_share import CpuShareError, cpu_root

        try:
            cpu_root()
            a.devices = "dedicated"
        except CpuShareError as exc:
            print(f"e2e: shared CPUs ({exc})", flush=True)
            a.devices = "shared"
    a.cpu_per_rank = "auto" if a.devices == "dedicated" else ""
    if not 0 < a.slow_at < a.kill_at < a.steps:
        ap.error(f"need 0 < --slow-at < --kill-at < --steps, got {a.slow_at}, {a.kill_at}, {a.steps}")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = set(policies) - {"resihp", "static", "restart"}
    if bad:
        ap.error(f"--policies: unknown {sorted(bad)}; choose from resihp, static, restart")
    starts = [x.strip() for x in a.start.split(",") if x.strip()]
    if not starts or set(starts) - {"best", "fixed"}:
        ap.error(f"--start: expected best and/or fixed, got {a.start!r}")
    out = Path(a.out).resolve() if a.out else Path(tempfile.mkdtemp(prefix="resihp-e2e-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"e2e: {a.steps} steps, rank 2 slow x2 at step {a.slow_at}, rank 5 killed at step {a.kill_at}, "
          f"checkpoints every {a.checkpoint_every}, {a.devices} devices; runs in {out}", flush=True)
    profile = None
    layouts = {"fixed": START_FIXED}
    if "best" in starts:
        print("layout profile of the 8 ranks (resihp launch --layout auto's) ...", flush=True)
        profile = best_healthy_layout(out, a)
        from resihp.trainer_hooks.runtime.autolayout import table

        print(table(profile), flush=True)
        layouts["best"] = str(profile["layout"])
    infos: dict[str, dict[str, dict[str, Any]]] = {}
    for start in starts:
        layout = layouts[start]
        cfg = RestartConfig(steps=a.steps, checkpoint_every=a.checkpoint_every, layout=layout,
                            cpu_per_rank=a.cpu_per_rank)
        infos[start] = {"layout": {"layout": layout}}
        for policy in policies:
            root = out / start / policy
            shutil.rmtree(root, ignore_errors=True)
            print(f"running {policy} from the {start} start ({layout}) ...", flush=True)
            t0 = time.time()
            if policy == "resihp":
                infos[start][policy] = run_resihp(root, a, layout)
            else:
                injections = [Injection("slow", 2, a.slow_at, 2.0, persist=policy == "static"),
                              Injection("kill", 5, a.kill_at)]
                infos[start][policy] = _restart_info(run_policy(policy, root, cfg, injections, log=sys.stdout), t0)
            print(f"  {policy}: {time.time() - t0:.0f} s", flush=True)
    print("reference (one process, no faults) ...", flush=True)
    ref = out / "reference-run"
    ref.mkdir(exist_ok=True)
    run_reference_into(ref, a)
    for start in starts:
        for policy in policies:
            dst = out / start / policy / "reference"
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy(ref / "reference" / "progress.jsonl", dst / "progress.jsonl")
    # kept before the report, which --recompute can then redo from it
    (out / "e2e.json").write_text(json.dumps({"result": {k: getattr(a, k) for k in (
        "steps", "slow_at", "kill_at", "checkpoint_every", "devices")}, "starts": infos, "profile": profile}, indent=1))
    return report(out, a, infos, profile)


def start_result(out: Path, layout: str, infos: dict[str, dict[str, Any]],
                 slow_step: int) -> tuple[dict[str, Any], bool]:
    """One start's table and numbers (and whether every policy finished)."""
    rows = {p: policy_numbers(p, out / p, info) for p, info in infos.items() if p != "layout"}
    print()
    print_table(list(rows.values()))
    res, st, rs = rows.get("resihp", {}), rows.get("static", {}), rows.get("restart", {})
    frac = healthy_fraction(RANKS, 1, 2.0)
    retained = retained_vs_bound(res.get("slow_phase_tokens_per_s"), res.get("healthy_tokens_per_s"), frac)
    parts = [res.get("healthy_rate_rel_se"), res.get("adapted_rate_rel_se")]
    static_kept = ratio(st.get("slow_phase_tokens_per_s"), st.get("healthy_tokens_per_s"))
    noise = retained * math.sqrt(sum(p * p for p in parts if p is not None)) if retained is not None and all(
        p is not None for p in parts) else None
    result = {
        "start_layout": layout,
        "tokens_per_s_static": st.get("tokens_per_s"), "tokens_per_s_restart": rs.get("tokens_per_s"),
        "tokens_per_s_resihp": res.get("tokens_per_s"),
        "resihp_vs_static": ratio(res.get("slow_phase_tokens_per_s"), st.get("slow_phase_tokens_per_s")),
        "resihp_vs_restart": ratio(res.get("tokens_per_s"), rs.get("tokens_per_s")),
        # the whole slow-then-kill job (static restarts from its checkpoint after the kill):
        # what a user of each sees; resihp_vs_static above is what the slowdown alone earns
        "resihp_vs_static_whole_run": ratio(res.get("tokens_per_s"), st.get("tokens_per_s")),
        # each run's slow-phase rate over its own healthy start: cancels the load other users
        # put on this shared machine between the runs
        "resihp_vs_static_normalized": ratio(ratio(res.get("slow_phase_tokens_per_s"), res.get("healthy_tokens_per_s")),
                                             ratio(st.get("slow_phase_tokens_per_s"), st.get("healthy_tokens_per_s"))),
        "throughput_retained_vs_bound": retained, "throughput_retained_noise": noise,
        # what the fault costs a job that does nothing here, and so the most any policy can
        # gain over it: the healthy compute fraction over the share static kept
        "static_slow_over_healthy": static_kept, "ceiling_vs_static": ratio(frac, static_kept),
        **(trace_itp_errors(out / "resihp", slow_step) if "resihp" in rows else {}),
        "loss_delta_vs_reference": res.get("loss_delta"),
        "detect_latency_s_slow": res.get("detect_latency_s_slow"),
        "detect_latency_s_stop": res.get("detect_latency_s_stop"),
        "loss_delta_static": st.get("loss_delta"), "loss_delta_restart": rs.get("loss_delta"),
        "slow_phase_tokens_per_s": {p: r["slow_phase_tokens_per_s"] for p, r in rows.items()},
        "healthy_tokens_per_s_resihp": res.get("healthy_tokens_per_s"),
        "resihp_adapted_before_kill": res.get("adapted_before_kill"),
        "detect_latency_s_static": [st.get("detect_latency_s_slow"), st.get("detect_latency_s_stop")],
        "restarts": {p: r["restarts"] for p, r in rows.items()},
        "startup_failures": {p: r["startup_failures"] for p, r in rows.items()},
        "finished": {p: r["finished"] for p, r in rows.items()},
    }
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return result, all(r["finished"] for r in rows.values())


HEADLINE = ("resihp_vs_static", "resihp_vs_static_whole_run", "resihp_vs_restart", "resihp_vs_static_normalized",
            "throughput_retained_vs_bound",
            "throughput_retained_noise", "ceiling_vs_static", "loss_delta_vs_reference", "post_replan_itp_error_3")


def report(out: Path, a: argparse.Namespace, starts: dict[str, dict[str, dict[str, Any]]],
           profile: dict[str, Any] | None) -> int:
    """The tables and the final JSON line, from the run directories under ``out``."""
    results: dict[str, dict[str, Any]] = {}
    ok = True
    for start, infos in starts.items():
        layout = str(infos.get("layout", {}).get("layout", START_FIXED))
        print(f"\n== {start} start: {layout}" + (" (the best healthy layout, profiled)" if start == "best" else ""))
        results[start], finished = start_result(out / start, layout, infos, a.slow_at)
        ok = ok and finished
    head = results.get("best") or results[next(iter(results))]
    result = {**head, "devices": getattr(a, "devices", ""), "steps": a.steps, "slow_at": a.slow_at, "kill_at": a.kill_at,
              "checkpoint_every": a.checkpoint_every, "out": str(out)}
    if "best" in results and "fixed" in results:
        result["fixed_start"] = {k: results["fixed"][k] for k in ("start_layout", *HEADLINE)}
    if profile is not None:
        result["layout_profile"] = {c["layout"]: (statistics.median(c["measured_s"]) if c["measured_s"] else None)
                                    for c in profile["candidates"]}
    print(f"\nrun directories: {out}/START/POLICY (resihp report DIR)")
    (out / "e2e.json").write_text(json.dumps({"result": result, "starts": starts, "profile": profile}, indent=1))
    print(json.dumps(_rounded(result)))
    return 0 if ok else 1


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
