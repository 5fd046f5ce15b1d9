"""The checkpoint-restart driver of bench/e2e.py: a job run as a sequence of `resihp launch` segments.

Policies (the same 8-rank job as `resihp demo`, saving a checkpoint every K steps):

- ``static``: the coordinator detects but never reconfigures and the ranks run with
  ``--no-resilience``. A fail-slow persists (the slow node is never replaced: after a
  relaunch it is throttled again); a fail-stop crashes the job, and the driver relaunches it
  on 8 fresh ranks (a replacement node, as a cluster manager would) from the latest
  checkpoint.
- ``restart``: like ``static``, but a confirmed fail-slow (a ``finding`` event of kind
  ``fail-slow`` in the segment's events.jsonl) also makes the driver stop the job and
  relaunch it from the latest checkpoint; the relaunch runs on fresh processes, so the
  throttle is gone (a replaced node).

Layout on disk (one directory per policy): ``POLICY/seg-NN/`` is the run directory of
segment NN (its own coordinator, events.jsonl, progress.jsonl; `resihp launch` resets a few
files in a run directory, so segments never share one), ``POLICY/ckpt/`` the checkpoints
all segments share, and, written by ``merge_segments``, ``POLICY/progress.jsonl`` and
``POLICY/events.jsonl`` (the segments' lines in order; one ``start`` line: the first
segment's), ``POLICY/demo.json`` (every injection, with its global step) and
``POLICY/segments.json``, so `resihp report POLICY` reads the whole run as one.

A segment ends when its launch exits (the job finished or crashed), when the driver decides
to restart (``restart_reason``), or when no step arrives for ``stall_s`` (a hung job). It is
ended by SIGTERM to the launch process (which stops mpirun, agents and coordinator), then
SIGKILL to whatever of its descendants is left. Each injection happens once across segments
(the global step numbering survives a restart), except a persistent one (static's slow
node), which is applied again in every later segment at its first step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resihp.demo import CPU_CLUSTER, CPU_POLICY, EXAMPLE, Follower, _resihp

POLICIES = ("static", "restart")


@dataclass
class Injection:
    kind: str  # slow | kill
    rank: int
    step: int  # injected once the job has completed step - 1 (as `resihp demo` does)
    factor: float = 2.0
    persist: bool = False  # re-applied at the first step of every later segment (a node nobody replaced)


@dataclass
class Segment:
    index: int
    run_dir: str
    launched: float  # wall clock when the launch started
    resumed_at: int  # the first step this segment trains (0, or the checkpoint's step + 1)
    first_step_end: float | None = None
    last_step_end: float | None = None
    ended: float = 0.0  # wall clock when the launch was gone
    steps: int = 0  # step lines written (re-done steps included)
    last_step: int = -1
    end_reason: str = ""  # finished | fail-stop | fail-slow | crashed (rc N) | stalled | start-up failure
    launch_rc: int | None = None


@dataclass
class RestartConfig:
    steps: int = 70
    checkpoint_every: int = 5
    seq: int = 128
    microbatches: int = 8
    seed: int = 0
    stall_s: float = 120.0  # no new step for this long: the job hung, relaunch
    startup_s: float = 300.0  # no first step for this long after the launch: a start-up failure
    timeout_s: float = 1500.0  # the whole policy run
    max_segments: int = 6
    layout: str = "TP2xPP2xDP2"  # the start (and every relaunch's) layout
    cpu_per_rank: str = ""  # resihp launch --cpu-per-rank (one device per rank on a shared machine)


@dataclass
class RestartRun:
    policy: str
    root: str
    segments: list[Segment] = field(default_factory=list)
    injections: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False


def restart_reason(events: Sequence[dict[str, Any]], policy: str) -> str | None:
    """Why the driver must stop this segment and relaunch, from its coordinator's events: a
    confirmed fail-stop (both policies) or fail-slow (``restart`` only); None: keep going."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    for ev in events:
        if ev.get("event") != "finding":
            continue
        if ev.get("kind") == "fail-stop":
            return "fail-stop"
        if ev.get("kind") == "fail-slow" and policy == "restart":
            return "fail-slow"
    return None


def startup_failed(launch_log: Path) -> bool:
    """A rank died while starting (before its first step): on this shared machine Open MPI
    sometimes fails a rank in MPI start-up (MPI_ERR_PROC_FAILED in the bootstrap's allgather),
    and the survivors then wait forever. Call only while the job has trained no step."""
    try:
        text = launch_log.read_bytes()
    except FileNotFoundError:
        return False
    return b"Traceback (most recent call last)" in text or b"MPI_ERR_PROC_FAILED" in text


def launch_command(run: Path, ckpt: Path, cfg: RestartConfig, resume: bool) -> list[str]:
    """`resihp launch` of the demo job, static: no reconfiguration, no in-job recovery."""
    profile = run / "profile" / "cluster.json"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(json.dumps(CPU_CLUSTER))
    coord = [f"--coordinator-arg=--cluster={profile}", "--coordinator-arg=--no-auto-reconfigure"]
    coord += [f"--coordinator-arg=--policy={p}" for p in CPU_POLICY]
    from resihp.coordinator.planner.autolayout import Layout

    lay = Layout.parse(cfg.layout)
    shape = ["--tp", str(lay.tp), "--pp", str(lay.pp), "--dp", str(lay.dp)]
    train = [sys.executable, str(EXAMPLE), *shape, "--steps", str(cfg.steps),
             "--seq", str(cfg.seq), "--microbatches", str(cfg.microbatches), "--seed", str(cfg.seed),
             "--log-every", "1000000", "--no-resilience", "--checkpoint-dir", str(ckpt),
             "--checkpoint-every", str(cfg.checkpoint_every)] + (["--resume"] if resume else [])
    quota = [f"--cpu-per-rank={cfg.cpu_per_rank}"] if cfg.cpu_per_rank else []
    return _resihp("launch", "-n", str(lay.tp * lay.pp * lay.dp), *shape, "--microbatches",
                   str(cfg.microbatches), "--run-dir", str(run), "--heartbeat-timeout-s", "20", *quota, *coord, "--",
                   *train)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop_launch(proc: subprocess.Popen[bytes], grace_s: float = 45.0) -> int:
    """End a launch we started: SIGTERM (it stops its job and daemons), then SIGKILL by pid to
    anything of it still alive after ``grace_s``."""
    kids = _descendants(proc.pid)  # its daemons run in their own sessions: remember them now
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for pid in kids + _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return int(proc.returncode)


def _inject(inj: Injection, run: Path, step: int) -> dict[str, Any]:
    extra = ["--factor", str(inj.factor)] if inj.kind == "slow" else []
    r = subprocess.run(_resihp("admin", "inject", inj.kind, "--rank", str(inj.rank), *extra, "--run-dir", str(run)),
                       capture_output=True, text=True, timeout=60)
    return {"kind": inj.kind, "rank": inj.rank, "factor": inj.factor, "step": step, "time": time.time(),
            "ok": r.returncode == 0, "admin_output": (r.stdout + r.stderr).strip()[:300]}


def _resume_step(ckpt: Path) -> int:
    from resihp.trainer_hooks.checkpoint.saver import latest_checkpoint, read_meta

    path = latest_checkpoint(ckpt)
    return int(read_meta(path)["resume_step"]) if path is not None else 0


def run_segment(out: RestartRun, cfg: RestartConfig, todo: list[Injection], persistent: list[Injection],
                deadline: float, log: Any = None) -> Segment:
    """One launch, followed until it finishes, crashes, stalls or must restart."""
    root = Path(out.root)
    k = len(out.segments)
    run = root / f"seg-{k:02d}"
    run.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    seg = Segment(k, str(run), time.time(), _resume_step(ckpt))
    cmd = launch_command(run, ckpt, cfg, resume=k > 0)
    with open(run / "launch.log", "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    progress, events = Follower(run / "progress.jsonl"), Follower(run / "events.jsonl")
    seen: list[dict[str, Any]] = []
    reapply = list(persistent)
    last_change = time.time()
    try:
        while True:
            rc = proc.poll()
            for rec in progress.new():
                if rec.get("type") != "step":
                    continue
                seg.steps += 1
                seg.last_step = int(rec["step"])
                seg.first_step_end = seg.first_step_end or float(rec["time"])
                seg.last_step_end = float(rec["time"])
                last_change = time.time()
            seen.extend(events.new())
            if rc is not None:
                seg.launch_rc = rc
                done = seg.last_step >= cfg.steps - 1
                crashed = "start-up failure" if seg.last_step < 0 else f"crashed (rc {rc})"
                seg.end_reason = "finished" if done and rc == 0 else (restart_reason(seen, out.policy) or crashed)
                break
            if seg.last_step >= 0:
                while reapply:  # a slow node nobody replaced is slow again in the relaunch
                    out.injections.append(_inject(reapply.pop(0), run, seg.last_step + 1))
                while todo and seg.last_step + 1 >= todo[0].step:
                    inj = todo.pop(0)
                    out.injections.append(_inject(inj, run, seg.last_step + 1))
                    if inj.persist:
                        persistent.append(inj)
            why = restart_reason(seen, out.policy)
            if why is None and seg.last_step < 0 and (startup_failed(run / "launch.log")
                                                      or time.time() - seg.launched > cfg.startup_s):
                why = "start-up failure"
            if why is None and seg.last_step >= 0 and time.time() - last_change > cfg.stall_s:
                why = "stalled"
            if why is None and time.time() > deadline:
                why = "timeout"
            if why is not None:
                seg.end_reason = why
                seg.launch_rc = stop_launch(proc)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            stop_launch(proc)
        seg.ended = time.time()
    if log is not None:
        print(f"  {out.policy} segment {k}: steps {seg.resumed_at}..{seg.last_step} ({seg.steps} lines), "
              f"{seg.ended - seg.launched:.0f} s, ended: {seg.end_reason}", file=log, flush=True)
    return seg


def run_policy(policy: str, root: Path, cfg: RestartConfig, injections: Sequence[Injection],
               log: Any = None) -> RestartRun:
    """The whole job under ``policy``: segments until the last step is trained (or give up)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    root.mkdir(parents=True, exist_ok=True)
    out = RestartRun(policy, str(root))
    todo = sorted(injections, key=lambda i: i.step)
    persistent: list[Injection] = []
    deadline = time.time() + cfg.timeout_s
    while len(out.segments) < cfg.max_segments and time.time() < deadline:
        seg = run_segment(out, cfg, todo, persistent, deadline, log)
        out.segments.append(seg)
        if seg.end_reason == "finished":
            out.finished = True
            break
    merge_segments(out)
    return out


def merge_segments(out: RestartRun) -> None:
    """Write the policy directory's own progress.jsonl, events.jsonl, demo.json, segments.json."""
    root = Path(out.root)
    prog: list[str] = []
    evs: list[str] = []
    started = False
    for seg in out.segments:
        run = Path(seg.run_dir)
        if (run / "progress.jsonl").is_file():
            for line in (run / "progress.jsonl").read_text(errors="replace").splitlines():
                if '"type":"start"' in line.replace(" ", ""):
                    if started:
                        continue
                    started = True
                prog.append(line)
        if (run / "events.jsonl").is_file():
            evs.extend((run / "events.jsonl").read_text(errors="replace").splitlines())
    (root / "progress.jsonl").write_text("".join(line + "\n" for line in prog if line.strip()))
    (root / "events.jsonl").write_text("".join(line + "\n" for line in evs if line.strip()))
    ok = [i for i in out.injections if i.get("ok")]
    (root / "demo.json").write_text(json.dumps({
        "scenario": {"policy": out.policy, "layout": "TP2xPP2xDP2", "ranks": 8, "finished": out.finished,
                     "segments": len(out.segments)},
        "injections": ok}, indent=1))
    (root / "segments.json").write_text(json.dumps({"policy": out.policy, "finished": out.finished,
                                                    "segments": [asdict(s) for s in out.segments],
                                                    "injections": out.injections}, indent=1))
