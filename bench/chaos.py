"""Chaos benchmark: a live 8-rank job (TP2 x PP2 x DP2, CPU, resihp's GPT on real text under
``resihp launch``) through each fault, each from a fresh start.

    python bench/chaos.py [--steps 40] [--only kill_backward,stop_forever] [--fuzz-cases 10000]

Scenarios: kill -9 of a rank inside its forward, backward, gradient sync and optimizer step
(``RESIHP_FAULT``, trainer_hooks/faults.py: the signal lands while the op runs); SIGSTOP of a
rank for good, and for 20 s and back; two ranks of different replicas killed together; a rank
killed inside a live reconfiguration (a 3x throttle makes the coordinator re-plan); kill -9 of
a node agent, of the coordinator, of the rendezvous store; a node agent killed with no restart
left (``--restart-budget 0``) and then a rank of its node stopped, which the launcher fences in
the agent's place; a co-tenant CPU hog on one core; the
run directory's file system turning read-only (an ext4 loop device that errors remount read-only; needs root); a burst of
fuzzed RPCs against the live daemons during training.

Per scenario: time to detect (fault -> the coordinator's finding or the launcher's restart),
time to resume (fault -> the first step after the recovery), steps lost, the final loss against
a single-process fault-free reference of the same model, seed and data, processes of the job
left after it ended, and a verdict. Then a fuzz run of ``--fuzz-cases`` cases against a live
job's daemons, unauthenticated requests on every endpoint, and the sockets the job's daemons
listen on. Prints a table, then ONE line of JSON: scenarios, survived, steps_lost_max,
loss_delta_max, orphans, hang_resume_s_max (goal <= the no-progress timeout + 5 s),
agent_kill_ranks_lost, agentless_hang_resume_s, coordinator_kill_ranks_lost, fuzz_cases, fuzz_daemon_crashes,
unauthenticated_accepted, listening_on_all_interfaces.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
SEQ, MICROBATCHES, TP, PP, DP = 64, 8, 2, 2, 2
VICTIM = 5  # replica 1, stage 0: holds state that only its DP peer also holds
LOSS_GOAL = 1e-4


@dataclass
class Scenario:
    name: str
    what: str
    env: dict[str, str] = field(default_factory=dict)  # RESIHP_FAULT for faults inside a rank
    at_step: int | None = None  # the bench acts once this step is done ...
    act: Callable[[Path, str], None] | None = None  # ... with (run dir, job)
    own_fs: bool = False  # the run directory on its own ext4 loop file system (read-only scenario)
    hang: bool = False
    launch_args: list[str] = field(default_factory=list)  # extra `resihp launch` options
    daemon_detects: bool = True  # a daemon's exit counts as detecting the fault (not where it is the set-up)


# --- helpers ---------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def job_processes(job: str) -> list[psutil.Process]:
    """Every live process of the job (its environment says RESIHP_JOB=job)."""
    out = []
    key = f"RESIHP_JOB={job}".encode()
    for p in psutil.process_iter(["pid"]):
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as fh:
                if key in fh.read().split(b"\0") and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def rank_pid(job: str, rank: int) -> int:
    for p in job_processes(job):
        try:
            env = open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and b"train_gpt.py" in b" ".join(
                a.encode() for a in p.cmdline()):
            return p.pid
    raise RuntimeError(f"no process of rank {rank} in job {job}")


def daemon_pid(run: Path, name: str) -> int:
    return int(json.loads((run / f"{name}.json").read_text())["pid"])


def mark(run: Path, what: str) -> None:
    with open(run / "faults.jsonl", "a") as fh:
        fh.write(json.dumps({"time": time.time(), "action": what}) + "\n")


def kill_ranks(*ranks: int) -> Callable[[Path, str], None]:
    def act(run: Path, job: str) -> None:
        pids = [rank_pid(job, r) for r in ranks]
        mark(run, f"kill ranks {list(ranks)}")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    return act


def stop_and_continue(rank: int, for_s: float) -> Callable[[Path, str], None]:
    def act(run: Path, job: str) -> None:
        pid = rank_pid(job, rank)
        mark(run, f"SIGSTOP rank {rank} for {for_s:g} s")
        os.kill(pid, signal.SIGSTOP)
        # the SIGCONT comes from a child process, so the bench goes on watching meanwhile
        subprocess.Popen(["sh", "-c", f"sleep {for_s}; kill -CONT {pid} 2>/dev/null"], start_new_session=True)
    return act


def kill_daemon(name: str) -> Callable[[Path, str], None]:
    def act(run: Path, job: str) -> None:
        pid = daemon_pid(run, name)
        mark(run, f"kill -9 {name}")
        os.kill(pid, signal.SIGKILL)
    return act


def agent_gone_then_stop(run: Path, job: str) -> None:
    """The agent of node1 dies and its restart budget is 0; then a rank of node1 stops for good.
    Nothing can deliver the coordinator's fence order: the launcher must carry it out."""
    os.kill(daemon_pid(run, "agent-node1"), signal.SIGKILL)
    deadline = time.time() + 20
    while not any(e.get("event") == "daemon-gave-up" for e in read_jsonl(run / "events.jsonl")):
        if time.time() > deadline:
            raise RuntimeError("the launcher did not give the agent up within 20 s")
        time.sleep(0.05)
    pid = rank_pid(job, VICTIM)
    mark(run, f"SIGSTOP rank {VICTIM}, its agent gone for good")
    os.kill(pid, signal.SIGSTOP)


def kill_store_then_rank(run: Path, job: str) -> None:
    """The store dies; the launcher restarts it empty on its address; then a rank dies, and the
    recovery's rendezvous must go through the restarted store."""
    pid = int(json.loads((run / "store.json").read_text())["pid"])
    mark(run, "kill -9 the store")
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline:  # the launcher's restart rewrites store.json
        if int(json.loads((run / "store.json").read_text())["pid"]) != pid:
            break
        time.sleep(0.1)
    done = {int(r["step"]) for r in read_jsonl(run / "progress.jsonl") if r.get("type") == "step"}
    target = max(done, default=0) + 3
    while time.time() < deadline and max(
            (int(r["step"]) for r in read_jsonl(run / "progress.jsonl") if r.get("type") == "step"), default=0) < target:
        time.sleep(0.05)
    kill_ranks(VICTIM)(run, job)


def cpu_hog(run: Path, job: str) -> None:
    mark(run, "CPU hog on core 0 for 15 s")
    subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c",
                      "import time\nt = time.time() + 15\nwhile time.time() < t: pass"], start_new_session=True)


def exclude_then_die(run: Path, job: str) -> None:
    mark(run, "operator excludes rank 3 (a live re-plan follows; rank 6 dies inside it)")
    subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "exclude", "--rank", "3", "--reason", "chaos",
                    "--run-dir", str(run)], capture_output=True, timeout=60, check=True)


def read_only(run: Path, job: str) -> None:
    """The kernel turns the run directory's file system read-only, as ext4 does on an I/O error
    (errors=remount-ro): every open file, the daemons' logs included, fails its next write."""
    dev = next(line.split()[0] for line in Path("/proc/mounts").read_text().splitlines()
               if line.split()[1] == str(run))
    mark(run, "run directory's file system turned read-only")
    Path(f"/sys/fs/ext4/{Path(dev).name}/trigger_fs_error").write_text("1")


def mount_ext4(run: Path) -> None:
    """A small ext4 file system of its own (a loop device) for the run directory."""
    image = run.with_suffix(".img")
    image.unlink(missing_ok=True)
    with open(image, "wb") as fh:
        fh.truncate(512 * 2**20)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(run)], check=True)


def fuzz_burst(cases: int) -> Callable[[Path, str], None]:
    def act(run: Path, job: str) -> None:
        from resihp.coordinator import fuzz

        mark(run, f"{cases} fuzzed RPCs")
        coordinator = json.loads((run / "coordinator.json").read_text())["grpc"]
        agent = json.loads((run / "agent-node0.json").read_text())["hook"]
        token = (run / "token").read_text().strip()
        res = fuzz.fuzz_endpoints(coordinator, agent, token, cases, seed=1, **daemon_pids(run))
        (run / "fuzz.json").write_text(json.dumps(res.to_dict(), default=str))
    return act


def daemon_pids(run: Path) -> dict[str, Any]:
    """The fuzzer's view of a live job: its daemons' pids (a crash is a pid gone) and the ranks'
    credential for the Hook service."""
    from resihp.coordinator.protocol.auth import rank_token

    return {"coordinator_pids": [daemon_pid(run, "coordinator")],
            "agent_pids": [daemon_pid(run, "agent-node0")],
            "rank_credential": rank_token((run / "token").read_text().strip())}


def scenarios(steps: int, fuzz_cases: int) -> list[Scenario]:
    at = max(8, steps // 4)
    f = f"{VICTIM}:{at}"
    return [
        Scenario("kill_forward", "kill -9 a rank inside a forward chunk", {"RESIHP_FAULT": f"kill:{f}:F"}),
        Scenario("kill_backward", "kill -9 a rank inside a backward chunk", {"RESIHP_FAULT": f"kill:{f}:B"}),
        Scenario("kill_grad_sync", "kill -9 a rank inside the DP all-reduce", {"RESIHP_FAULT": f"kill:{f}:DP"}),
        Scenario("kill_optimizer", "kill -9 a rank inside the optimizer step",
                 {"RESIHP_FAULT": f"kill:{f}:optimizer"}),
        Scenario("stop_forever", "SIGSTOP a rank for good", {"RESIHP_FAULT": f"stop:{f}"}, hang=True),
        Scenario("stop_20s", "SIGSTOP a rank for 20 s, then SIGCONT", at_step=at, act=stop_and_continue(VICTIM, 20),
                 hang=True),
        Scenario("kill_two", "kill -9 two ranks of different replicas together", at_step=at, act=kill_ranks(2, 5)),
        Scenario("kill_in_reconfig", "kill -9 a rank inside a live reconfiguration",
                 {"RESIHP_FAULT": "kill:6:0:switch"}, at_step=at // 2, act=exclude_then_die),
        Scenario("kill_agent", "kill -9 the agent of node1", at_step=at, act=kill_daemon("agent-node1")),
        Scenario("agent_gone_stop", "kill -9 node1's agent (restart budget 0), then SIGSTOP a rank of node1",
                 at_step=at, act=agent_gone_then_stop,
                 launch_args=["--restart-budget", "0", "--coordinator-arg=--agent-grace-s=1"], daemon_detects=False),
        Scenario("kill_coordinator", "kill -9 the coordinator", at_step=at, act=kill_daemon("coordinator")),
        Scenario("kill_store", "kill -9 the rendezvous store, then a rank 3 steps later", at_step=at,
                 act=kill_store_then_rank),
        Scenario("cpu_hog", "a co-tenant CPU hog on core 0 for 15 s", at_step=at, act=cpu_hog),
        Scenario("read_only_disk", "the run directory turns read-only", at_step=at, act=read_only, own_fs=True),
        Scenario("fuzz_burst", f"{fuzz_cases // 5} fuzzed RPCs during training", at_step=at,
                 act=fuzz_burst(max(200, fuzz_cases // 5))),
    ]


# --- one run -----------------------------------------------------------------------------------

def launch_line(run: Path, steps: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "resihp.cli", "launch", "-n", str(TP * PP * DP), "--tp", str(TP), "--pp", str(PP),
            "--dp", str(DP), "--nodes", "2", "--microbatches", str(MICROBATCHES), "--gpu-sampler", "off",
            "--run-dir", str(run), "--stall-timeout-s", "120", *(extra or []), "--",
            sys.executable, str(SCRIPT), "--tp", str(TP), "--pp", str(PP), "--dp", str(DP), "--steps", str(steps),
            "--seq", str(SEQ), "--microbatches", str(MICROBATCHES), "--seed", "0", "--log-every", "1"]


def steps_done(run: Path, out: str) -> set[int]:
    """Steps some rank logged as done: progress.jsonl, else (a read-only run directory) the
    loss lines of the launch output."""
    got = {int(r["step"]) for r in read_jsonl(run / "progress.jsonl") if r.get("type") == "step"}
    got |= {int(m.group(1)) for m in re.finditer(r"^step\s+(\d+)\s+loss", out, re.M)}
    return got


def final_loss(run: Path, out: str, step: int) -> float | None:
    for r in read_jsonl(run / "progress.jsonl"):
        if r.get("type") == "step" and int(r["step"]) == step and r.get("loss") is not None:
            return float(r["loss"])
    found = re.findall(rf"^step\s+{step}\s+loss\s+([0-9.]+)", out, re.M)
    return float(found[-1]) if found else None


def run_one(sc: Scenario, steps: int, root: Path, ref_loss: float | None) -> dict[str, Any]:
    run = root / sc.name
    if run.exists():
        subprocess.run(["umount", str(run)], capture_output=True)
        shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    if sc.own_fs:
        mount_ext4(run)
    env = {**os.environ, **sc.env}
    t0 = time.time()
    proc = subprocess.Popen(launch_line(run, steps, sc.launch_args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    job = ""
    acted_at: float | None = None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    while proc.poll() is None:
        if not job:
            m = re.search(r"resihp launch: job (\S+),", "".join(lines))
            job = m.group(1) if m else ""
        if sc.act is not None and acted_at is None and job:
            done = steps_done(run, "".join(lines))
            if sc.at_step is not None and done and max(done) >= sc.at_step:
                try:
                    sc.act(run, job)
                except Exception as exc:  # noqa: BLE001 - the scenario's verdict says it
                    lines.append(f"\nchaos: the fault could not be injected: {exc}\n")
                acted_at = time.time()
        if time.time() - t0 > 600:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
            break
        time.sleep(0.05)
    reader.join(10)
    out = "".join(lines)
    orphans = [p.pid for p in job_processes(job)] if job else []
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if sc.own_fs:  # keep what it wrote: copy it off its file system
        keep = root / f"{sc.name}.kept"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(run, keep, dirs_exist_ok=True)
        subprocess.run(["umount", str(run)], capture_output=True)
        run.with_suffix(".img").unlink(missing_ok=True)
        run = keep
    (run / "launch.out").write_text(out)
    return judge(sc, run, out, proc.returncode, steps, ref_loss, orphans, t0)


def fault_time(run: Path) -> float | None:
    marks = read_jsonl(run / "faults.jsonl")
    own = [x for x in marks if "rank" in x]  # a rank's own fault record: the moment it landed
    if own:
        return min(float(x["time"]) for x in own)
    # else the bench's last act (kill_store: the rank killed after the store's restart)
    return max(float(x["time"]) for x in marks) if marks else None


def judge(sc: Scenario, run: Path, out: str, rc: int | None, steps: int, ref_loss: float | None,
          orphans: list[int], t0: float) -> dict[str, Any]:
    tf = fault_time(run)
    events = read_jsonl(run / "events.jsonl")
    progress = read_jsonl(run / "progress.jsonl")
    detect = [float(e["time"]) for e in events if tf is not None and float(e.get("time", 0)) >= tf - 0.5
              and (e.get("event") == "finding" and e.get("kind") == "fail-stop"
                   or (sc.daemon_detects and e.get("event") in ("daemon-exited", "agent-lost")))]
    detect_s = round(min(detect) - tf, 3) if detect and tf is not None else None
    replans = [float(r["time"]) for r in progress if r.get("type") == "reconfig" and tf is not None
               and float(r["time"]) >= tf]
    after = max(replans[:1] or [tf or 0.0])
    resumed = [float(r["time"]) for r in progress if r.get("type") == "step" and float(r["time"]) > after]
    resume_s = round(min(resumed) - tf, 3) if resumed and tf is not None else None
    done = steps_done(run, out)
    lost = len(set(range(steps)) - done)
    loss = final_loss(run, out, steps - 1)
    delta = abs(loss - ref_loss) / abs(ref_loss) if loss is not None and ref_loss else None
    hang_after = [float(m.group(1)) for m in re.finditer(r"hang after ([0-9.]+) s", json.dumps(events))]
    ranks_lost = sorted({r for e in events if e.get("event") == "finding" and e.get("kind") == "fail-stop"
                         for r in e.get("ranks", [])})
    fuzz = json.loads((run / "fuzz.json").read_text()) if (run / "fuzz.json").exists() else None
    survived = rc == 0 and lost == 0 and delta is not None and delta <= LOSS_GOAL and not orphans
    return {"scenario": sc.name, "what": sc.what, "rc": rc, "detect_s": detect_s, "resume_s": resume_s,
            "steps_lost": lost, "final_loss": loss, "loss_delta": delta, "orphans": len(orphans),
            "ranks_declared_dead": ranks_lost, "hang": sc.hang,
            "no_progress_timeout_s": min(hang_after) if hang_after else None,
            "fenced": sum(1 for e in events if e.get("event") == "fence-result" and e.get("ok")),
            "daemon_restarts": sum(1 for e in events if e.get("event") == "daemon-restarted"),
            "fuzz": fuzz, "wall_s": round(time.time() - t0, 1), "survived": survived, "run_dir": str(run)}


def reference(steps: int, root: Path, name: str = "reference") -> float | None:
    ref = root / name
    ref.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_")}
    env["RESIHP_PROGRESS"] = str(ref / "progress.jsonl")
    (ref / "progress.jsonl").unlink(missing_ok=True)
    subprocess.run([sys.executable, str(SCRIPT), "--steps", str(steps), "--seq", str(SEQ), "--microbatches",
                    str(MICROBATCHES), "--seed", "0", "--log-every", "1000000"], env=env, check=True,
                   capture_output=True, timeout=1200)
    return final_loss(ref, "", steps - 1)


# --- security and fuzz against a live job -----------------------------------------------------

def security_checks(steps: int, root: Path, fuzz_cases: int) -> dict[str, Any]:
    """A fault-free job: while it trains, the job's daemons' listening sockets, requests with no
    credential on every endpoint, and ``fuzz_cases`` fuzzed requests; the job must finish."""
    from resihp.coordinator import fuzz
    from resihp.trainer_hooks.launch.ports import listening_on_all_interfaces, unauthenticated_probe

    out: dict[str, Any] = {}

    def act(run: Path, job: str) -> None:
        daemons = [p.pid for p in job_processes(job) if "resihp.cli" in " ".join(p.cmdline())]
        out["listening_on_all_interfaces"] = listening_on_all_interfaces(daemons)
        out["unauthenticated"] = unauthenticated_probe(run)
        coordinator = json.loads((run / "coordinator.json").read_text())["grpc"]
        agent = json.loads((run / "agent-node0.json").read_text())["hook"]
        t = time.perf_counter()
        token = (run / "token").read_text().strip()
        res = fuzz.fuzz_endpoints(coordinator, agent, token, fuzz_cases, seed=0, **daemon_pids(run))
        out["fuzz_s"] = round(time.perf_counter() - t, 1)
        out["fuzz"] = res.to_dict()

    # the job trains until the checks are done, then the operator drains it: its losses up to
    # there must be the reference's, and no rank may have been declared dead
    long_steps = 600
    def act_then_drain(run: Path, job: str) -> None:
        act(run, job)
        drain(run)

    sc = Scenario("security", "no fault: sockets, unauthenticated requests and fuzzing against the live job",
                  at_step=4, act=act_then_drain)
    reference(long_steps, root, "reference-security")
    row = run_one(sc, long_steps, root, None)
    row.update(out)
    run = Path(row["run_dir"])
    done = steps_done(run, (run / "launch.out").read_text())
    last = max(done, default=-1)
    ref = {int(r["step"]): float(r["loss"]) for r in read_jsonl(root / "reference-security" / "progress.jsonl")
           if r.get("type") == "step"}
    loss = final_loss(run, "", last)
    row["steps_done"] = last + 1
    row["steps_lost"] = len(set(range(last + 1)) - done)
    row["loss_delta"] = abs(loss - ref[last]) / abs(ref[last]) if loss is not None and last in ref else None
    row["survived"] = (row["rc"] == 0 and row["steps_lost"] == 0 and not row["ranks_declared_dead"]
                       and row["loss_delta"] is not None and row["loss_delta"] <= LOSS_GOAL and not row["orphans"])
    return row


def drain(run: Path) -> None:
    subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "drain", "--reason", "chaos checks done",
                    "--run-dir", str(run)], capture_output=True, timeout=60, check=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--fuzz-cases", type=int, default=10000)
    ap.add_argument("--no-security", action="store_true", help="skip the fuzz / socket / credential checks")
    ap.add_argument("--root", default="", help="where the runs go (default: a temporary directory)")
    a = ap.parse_args(argv)
    root = Path(a.root or tempfile.mkdtemp(prefix="resihp-chaos-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in scenarios(a.steps, a.fuzz_cases) if not a.only or s.name in a.only.split(",")]
    print(f"chaos: {len(chosen)} scenarios of {TP * PP * DP} ranks (TP{TP}xPP{PP}xDP{DP}), {a.steps} steps each; "
          f"runs in {root}", flush=True)
    ref_loss = reference(a.steps, root)
    rows = []
    for sc in chosen:
        row = run_one(sc, a.steps, root, ref_loss)
        rows.append(row)
        print(f"  {row['scenario']:18s} rc {row['rc']}  detect {row['detect_s']}  resume {row['resume_s']}  "
              f"lost {row['steps_lost']}  loss delta {row['loss_delta']}  orphans {row['orphans']}  "
              f"{'SURVIVED' if row['survived'] else 'FAILED'}  ({row['wall_s']} s)", flush=True)
    sec = {} if a.no_security else security_checks(a.steps, root, a.fuzz_cases)
    print("\nscenario            detect_s  resume_s  steps_lost  loss_delta   orphans  dead ranks  verdict")
    for r in rows:
        delta = f"{r['loss_delta']:.2e}" if r["loss_delta"] is not None else "-"
        print(f"{r['scenario']:18s} {r['detect_s'] if r['detect_s'] is not None else '-':>9} "
              f"{r['resume_s'] if r['resume_s'] is not None else '-':>9} {r['steps_lost']:>11} {delta:>11} "
              f"{r['orphans']:>9}  {str(r['ranks_declared_dead']):10s}  {'survived' if r['survived'] else 'FAILED'}")
    hangs = [r for r in rows if r["hang"] and r["resume_s"] is not None]
    timeout = max((r["no_progress_timeout_s"] or 0.0 for r in hangs), default=0.0)
    fz = sec.get("fuzz") or {}
    result = {
        "scenarios": len(rows),
        "survived": sum(r["survived"] for r in rows),
        "steps_lost_max": max((r["steps_lost"] for r in rows), default=None),
        "loss_delta_max": max((r["loss_delta"] for r in rows if r["loss_delta"] is not None), default=None),
        "orphans": sum(r["orphans"] for r in rows) + int(sec.get("orphans", 0)),
        "hang_resume_s_max": max((r["resume_s"] for r in hangs), default=None),
        "hang_resume_goal_s": round(timeout + 5, 2) if hangs else None,
        "agent_kill_ranks_lost": next((len(r["ranks_declared_dead"]) for r in rows if r["scenario"] == "kill_agent"),
                                      None),
        # a stuck rank on a node with no agent: found by silence (grace + heartbeat timeout), not by
        # the no-progress verdict, so it is not held to the hang goal
        "agentless_hang_resume_s": next((r["resume_s"] for r in rows if r["scenario"] == "agent_gone_stop"), None),
        "coordinator_kill_ranks_lost": next((len(r["ranks_declared_dead"]) for r in rows
                                             if r["scenario"] == "kill_coordinator"), None),
        "fuzz_cases": fz.get("cases"),
        "fuzz_daemon_crashes": fz.get("daemon_crashes"),
        "fuzz_unexpected": len(fz.get("unexpected", []) or []) if fz else None,
        "unauthenticated_accepted": (sum(1 for v in sec["unauthenticated"].values() if v == "accepted")
                                     if "unauthenticated" in sec else None),
        "listening_on_all_interfaces": (len(sec["listening_on_all_interfaces"])
                                        if "listening_on_all_interfaces" in sec else None),
        "security_run_survived": sec.get("survived"),
        "rows": rows,
        "security": {k: v for k, v in sec.items() if k not in ("fuzz",)} | {"fuzz": fz},
        "root": str(root),
    }
    (root / "chaos.json").write_text(json.dumps(result, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "security")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
