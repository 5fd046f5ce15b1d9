"""A user's own loop under resihp: the nanoGPT example (examples/nanogpt/) under `resihp launch`.

    python bench/own_loop.py [--healthy 5] [--pairs 3] [--iters 200]

Runs, each from a fresh start, 4 ranks of DDP on CPU (gloo):
- healthy runs with default settings (the last one beside a co-tenant busy process): a healthy
  job is observed, never aborted;
- one run with a 1.3x slower device on one rank (its forward and backward stretched from
  inside by the hooks' throttle, RESIHP_THROTTLE): the finding must name that rank alone; and
  the same slowdown from outside (SIGSTOP / SIGCONT duty cycling), reported beside it;
- one run with `kill -9` of a rank: every survivor must exit within seconds (not hang in gloo),
  the launcher must exit non-zero, and no process may be left behind; the same with SIGSTOP
  (a rank that holds the job up without exiting: found by no progress, not the heartbeat timeout);
- interleaved pairs of the same script under `torchrun` (train_plain.py) and `resihp launch`
  (train.py): the per-iteration time ratio (the overhead of the two calls and the sidecars).

Prints a table, then one JSON line with the metrics issue #24 names.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "nanogpt"
BIN = Path(sys.executable).parent
RANKS = 4
SLOW_RANK = 2
SLOW_FROM = 60  # the iteration a slowdown starts: after the detector's warm-up (about 40 iterations)
KILL_RANK = 2
DUTY_STOP = 1 - 1 / 1.3  # stopped this share of each period: the rank runs at 1/1.3 speed
DUTY_PERIOD_S = 0.02  # short periods: each forward (a few ms) is slowed, not one in five stopped


@dataclass
class Run:
    name: str
    rc: int
    wall_s: float
    iter_ms: list[float]
    final_loss: float | None
    run_dir: Path | None
    stdout: str
    events: list[dict[str, Any]] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def findings(self, kind: str = "fail-slow") -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "finding" and e.get("kind") == kind]

    @property
    def aborted(self) -> bool:
        states = [e for e in self.events if e.get("event") == "state"]
        return self.rc != 0 or any(e.get("to") == "ABORTED" for e in states)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _parse(stdout: str) -> tuple[list[float], float | None]:
    iters, final = [], None
    for line in stdout.splitlines():
        if line.startswith("iter ") and "time " in line:
            iters.append(float(line.split("time ")[1].split("ms")[0]))
        elif line.startswith("final loss "):
            final = float(line.split()[-1])
    return iters, final


def _overrides(iters: int) -> list[str]:
    return [f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--log_interval=1", "--eval_interval=0"]


def _rank_pids(run_dir: Path) -> dict[int, int]:
    """The live training processes of the run in ``run_dir``, by MPI rank."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if not any("train.py" in part for part in proc.info["cmdline"] or ()):
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get("RESIHP_RUN_DIR") == str(run_dir) and "OMPI_COMM_WORLD_RANK" in env:
            found[int(env["OMPI_COMM_WORLD_RANK"])] = proc.pid
    return found


def _left_behind(run_dir: Path) -> list[str]:
    """Processes of a finished run still alive: ranks, agents, coordinator, store, mpirun."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or ())
            if str(run_dir) in cmd or proc.environ().get("RESIHP_RUN_DIR") == str(run_dir):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {cmd[:80]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return left


def _steps_done(run_dir: Path) -> int:
    return sum(1 for r in _jsonl(run_dir / "progress.jsonl") if r.get("type") == "step")


def resihp_run(name: str, root: Path, iters: int, during: Any = None, timeout_s: float = 600,
               env: dict[str, str] | None = None) -> Run:
    """``resihp launch -n 4 -- python train.py`` with default settings; ``during(run_dir, proc)``
    runs beside the job (fault injection) in a thread; ``env``: extra environment."""
    run_dir = root / name
    cmd = [str(BIN / "resihp"), "launch", "-n", str(RANKS), "--run-dir", str(run_dir), "--",
           sys.executable, str(EXAMPLE / "train.py"), *_overrides(iters)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=EXAMPLE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    extra: dict[str, Any] = {}
    worker = None
    if during is not None:
        worker = threading.Thread(target=lambda: extra.update(during(run_dir, proc) or {}), daemon=True)
        worker.start()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        extra["timed_out"] = True
    wall = time.perf_counter() - t0
    if worker is not None:
        worker.join(timeout=30)
    extra["left_behind"] = _left_behind(run_dir)
    iter_ms, final = _parse(out)
    return Run(name, proc.returncode, wall, iter_ms, final, run_dir, out, _jsonl(run_dir / "events.jsonl"),
               _jsonl(run_dir / "progress.jsonl"), extra)


def torchrun_run(name: str, iters: int, timeout_s: float = 600) -> Run:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}", str(EXAMPLE / "train_plain.py"),
           *_overrides(iters)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=EXAMPLE, capture_output=True, text=True, timeout=timeout_s)
    iter_ms, final = _parse(done.stdout)
    return Run(name, done.returncode, time.perf_counter() - t0, iter_ms, final, None, done.stdout + done.stderr)


def _wait_for(pred: Any, timeout_s: float, proc: subprocess.Popen[str]) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.05)
    return False


def slow_one_rank(start_step: int) -> Any:
    def inject(run_dir: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
        if not _wait_for(lambda: _steps_done(run_dir) >= start_step, 300, proc):
            return {"injected": False}
        pid = _rank_pids(run_dir).get(SLOW_RANK)
        if pid is None:
            return {"injected": False}
        began = time.time()
        target = psutil.Process(pid)
        try:
            while proc.poll() is None:
                target.send_signal(signal.SIGSTOP)
                time.sleep(DUTY_PERIOD_S * DUTY_STOP)
                target.send_signal(signal.SIGCONT)
                time.sleep(DUTY_PERIOD_S * (1 - DUTY_STOP))
        except psutil.NoSuchProcess:
            pass
        return {"injected": True, "inject_time": began}
    return inject


def signal_one_rank(at_step: int, sig: signal.Signals) -> Any:
    """At ``at_step``, send ``sig`` to rank KILL_RANK (SIGKILL: it dies; SIGSTOP, never
    continued: it holds the job up without exiting) and time until every survivor has exited."""
    def inject(run_dir: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
        if not _wait_for(lambda: _steps_done(run_dir) >= at_step, 300, proc):
            return {"signalled": False}
        pids = _rank_pids(run_dir)
        if KILL_RANK not in pids:
            return {"signalled": False}
        survivors = [psutil.Process(p) for r, p in pids.items() if r != KILL_RANK]
        os.kill(pids[KILL_RANK], sig)
        sent = time.monotonic()
        _, alive = psutil.wait_procs(survivors, timeout=60)
        took = time.monotonic() - sent if not alive else None
        if sig == signal.SIGSTOP:
            try:  # the stopped rank itself: continue it so the launcher can end it
                os.kill(pids[KILL_RANK], signal.SIGCONT)
            except ProcessLookupError:
                pass
        return {"signalled": True, "survivors_exit_s": took, "survivors_alive": len(alive)}
    return inject


def busy_co_tenant() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def inject_iteration(run: Run) -> int | None:
    began = run.extra.get("inject_time")
    if began is None:
        return None
    steps = [r for r in run.progress if r.get("type") == "step"]
    after = [int(r["step"]) for r in steps if float(r.get("time", 0)) >= began]
    return min(after) if after else None


def judge_slow(run: Run, first: int) -> tuple[bool, int | None, list[int], list[int]]:
    """(found on the slow rank alone, iterations from ``first`` to the first finding, ranks
    found from ``first`` on, ranks found before it)."""
    after = [f for f in run.findings() if int(f.get("iteration", -1)) >= first]
    before = sorted({r for f in run.findings() if int(f.get("iteration", -1)) < first for r in f.get("ranks", [])})
    ranks = sorted({r for f in after for r in f.get("ranks", [])})
    iters = int(after[0]["iteration"]) - first + 1 if after else None
    return bool(after) and ranks == [SLOW_RANK] and not before, iters, ranks, before


def hook_lines_added() -> int:
    plain = (EXAMPLE / "train_plain.py").read_text().splitlines()
    hooked = (EXAMPLE / "train.py").read_text().splitlines()
    return sum(1 for line in difflib.unified_diff(plain, hooked, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--healthy", type=int, default=5, help="healthy runs with default settings (+1 with a co-tenant)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved torchrun / resihp pairs for the overhead")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="resihp-own-loop-") as tmp:
        root = Path(tmp)
        healthy: list[Run] = []
        for i in range(args.healthy + 1):
            hog = busy_co_tenant() if i == args.healthy else None
            try:
                run = resihp_run(f"healthy{i}", root, args.iters)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            healthy.append(run)
            label = "healthy + co-tenant" if hog is not None else "healthy"
            rows.append((f"{label} #{i}", f"rc {run.rc}, {len(run.findings())} fail-slow findings "
                         f"{sorted({r for f in run.findings() for r in f.get('ranks', [])})}, aborted {run.aborted}, "
                         f"final loss {run.final_loss}, {run.wall_s:.1f} s"))
        # a slower device: rank 2's forward and backward take 1.3x as long from iteration 60 (after
        # the detector's warm-up) — the hooks' throttle stalls inside each span, as a host waits
        # on a slow accelerator (RESIHP_THROTTLE, docs/runtime.md)
        slow = resihp_run("slow", root, args.iters, env={"RESIHP_THROTTLE": f"{SLOW_RANK}:1.3@{SLOW_FROM}"})
        localised, detect_iters, ranks, false_before = judge_slow(slow, SLOW_FROM)
        rows.append((f"slow rank {SLOW_RANK} x1.3 (device)", f"from iteration {SLOW_FROM}; findings after it on ranks "
                     f"{ranks}, before it {false_before}; first after {detect_iters} iterations; rc {slow.rc}"))
        # the same from outside: SIGSTOP / SIGCONT duty cycling of the process (on 2 shared cores
        # every peer's spans swell with it: see the closing note of issue 24)
        stopped = resihp_run("sigstop", root, args.iters, during=slow_one_rank(start_step=SLOW_FROM))
        first = inject_iteration(stopped)
        sig_localised, sig_iters, sig_ranks, sig_before = judge_slow(stopped, first if first is not None else SLOW_FROM)
        rows.append((f"slow rank {SLOW_RANK} x1.3 (SIGSTOP)", f"from iteration {first}; findings after it on ranks "
                     f"{sig_ranks}, before it {sig_before}; first after {sig_iters} iterations; rc {stopped.rc}"))
        kill = resihp_run("kill", root, args.iters, during=signal_one_rank(40, signal.SIGKILL))
        time.sleep(1.0)  # let the launcher's own cleanup finish before counting what is left
        orphans = _left_behind(kill.run_dir) if kill.run_dir else []
        rows.append(("kill -9 rank 2", f"survivors exited after {kill.extra.get('survivors_exit_s')} s; "
                     f"launcher rc {kill.rc}; orphans {len(orphans)}"))
        hung = resihp_run("sigstop-hang", root, args.iters, during=signal_one_rank(40, signal.SIGSTOP))
        time.sleep(1.0)
        hung_orphans = _left_behind(hung.run_dir) if hung.run_dir else []
        stop_finding = next((f for f in hung.events if f.get("event") == "finding" and f.get("kind") == "fail-stop"), {})
        rows.append(("SIGSTOP rank 2 (hang)", f"survivors exited after {hung.extra.get('survivors_exit_s')} s; "
                     f"finding {stop_finding.get('cause')} on {stop_finding.get('ranks')}; launcher rc {hung.rc}; "
                     f"orphans {len(hung_orphans)}"))
        ratios = []
        for i in range(args.pairs):
            plain = torchrun_run(f"torchrun{i}", args.iters)
            hooked = resihp_run(f"paired{i}", root, args.iters)
            if plain.iter_ms[10:] and hooked.iter_ms[10:]:
                ratios.append(statistics.median(hooked.iter_ms[10:]) / statistics.median(plain.iter_ms[10:]))
            rows.append((f"pair {i}", f"torchrun {statistics.median(plain.iter_ms[10:] or [0]):.1f} ms/iter, "
                         f"resihp {statistics.median(hooked.iter_ms[10:] or [0]):.1f} ms/iter"))
        left = sum(len(r.extra.get("left_behind", [])) for r in healthy) + len(orphans) + len(hung_orphans)
    width = max(len(k) for k, _ in rows)
    print(f"{'run':<{width}}  result")
    print("-" * (width + 60))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    metrics = {
        "healthy_runs": len(healthy),
        "healthy_runs_aborted": sum(1 for r in healthy if r.aborted),
        "healthy_fail_slow_findings": sum(len(r.findings()) for r in healthy),
        "slow_rank_localised": localised,
        "slow_detect_iters": detect_iters,
        "sigstop_rank_localised": sig_localised,
        "sigstop_detect_iters": sig_iters,
        "kill_survivors_exit_s": kill.extra.get("survivors_exit_s"),
        "launcher_rc_after_kill": kill.rc,
        "hang_survivors_exit_s": hung.extra.get("survivors_exit_s"),
        "hang_cause": stop_finding.get("cause"),
        "launcher_rc_after_hang": hung.rc,
        "orphans": left,
        "hook_lines_added": hook_lines_added(),
        "overhead_ratio": round(statistics.mean(ratios), 4) if ratios else None,
        "overhead_ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)] if ratios else None,
    }
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
