"""Your own model, fully resilient: nanoGPT and a Hugging Face Llama under `resihp launch`.

    python bench/your_model.py [--steps 70 --slow-at 14 --kill-at 42 --models nanogpt,llama]

Per model: `resihp demo`'s scenario with the model's example loop (examples/nanogpt/
train_resilient.py, examples/llama/train.py): 8 ranks TP2 x PP2 x DP2 on CPU, rank 2 computes
2x slower from --slow-at (resihp detects it, re-plans, reshards live), a rank that holds state
is SIGKILLed at --kill-at (recovery from the surviving replica, rollback to the agreed step);
then the same model, seed and data in one process, fault-free. Then, on one `mpirun -n 8`,
the lower bound of every switch the runs made (bytes moved / loopback bandwidth + regroup
latency of its target plan, each the best of several, as bench/reconfigure.py measures them;
for a fail-stop also the ULFM Revoke + Shrink of the world once a rank is killed),
and fault-free runs of candidate layouts on the ranks that remain healthy (8 minus the killed
and the throttled one).

Prints a table, then ONE line of JSON with, per model:
- slow_detect_iters (goal <= 5), stop_detect_s (<= 3): injection to the matching finding;
- downtime_over_bound (<= 2): the worst switch of the run; a fail-stop's downtime runs from
  the last completed step, so it holds the killed step's work and the wait to notice the kill;
  failstop_recovery_over_bound: the same switch from the loss rank's notice (its downtime less
  its ``detect`` phase), the part the bound describes;
- final_loss_rel_diff (<= 1e-4) against the single-process run; steps_lost (0): steps of the
  requested range never trained; steps_redone: steps trained again after a rollback;
- throughput_retained_after_replan: steps/s after the last re-plan over the best fault-free
  steps/s of the candidate layouts on the healthy remaining ranks (the chosen one included).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/reconfigure.py's bound measurement
SCRIPTS = {"nanogpt": REPO / "examples" / "nanogpt" / "train_resilient.py", "llama": REPO / "examples" / "llama" / "train.py",
           "gpt": REPO / "examples" / "train_gpt.py"}  # gpt: resihp's own GPT, for comparison (--models gpt,...)
MPIRUN = Path(sys.executable).parent / "mpirun"
LAYERS = 4
SEQ = 64
MICROBATCHES = 8
CANDIDATES = ((1, 1, 6), (1, 2, 3), (1, 4, 1), (2, 2, 1), (2, 1, 3), (1, 1, 2), (1, 2, 1))  # (tp, pp, dp)


def _mpirun(n: int, args: list[str], env: dict[str, str] | None = None, timeout: float = 600.0,
            mpi_flags: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", *(mpi_flags or []), "-n", str(n),
           "-x", "OMP_NUM_THREADS=1", *(x for k in (env or {}) for x in ("-x", k)), sys.executable, *args]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


# --- the bound: loopback bandwidth and regroup latency (one mpirun -n 8) ---------------------

def bound_worker(plans_file: Path, out: Path) -> None:
    import torch
    from reconfigure import RegroupRounds, loopback_bandwidth

    from resihp.coordinator.model.plan import Plan
    from resihp.trainer_hooks.launch.bootstrap import Bootstrap

    torch.set_num_threads(1)
    boot = Bootstrap(timeout_s=120)
    comm, rank = boot.comm, boot.rank
    store = boot.info().store_addr
    boot.init_epoch(0)
    bw = loopback_bandwidth(comm, rank)
    rounds = RegroupRounds(comm, store, rank, boot.world_size)
    regroup = {key: min(rounds.measure(Plan.from_dict(plan))) for key, plan in json.loads(plans_file.read_text()).items()}
    shrink = shrink_seconds(comm, rank, boot.world_size)
    if rank == 0:
        out.write_text(json.dumps({"loopback_Bps": bw, "regroup_s": regroup, "shrink_s": shrink}))


def shrink_seconds(comm: Any, rank: int, world: int) -> float:
    """What a fail-stop pays before any state moves: the survivors' ULFM Revoke + Shrink of the
    communicator, timed once the failure is known (its detection is measured apart), max over
    survivors. The last rank SIGKILLs itself; the world is unusable afterwards."""
    import signal

    from mpi4py import MPI

    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.Barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:  # until MPI reports the failure (a collective with the dead rank fails)
            comm.Barrier()
    except MPI.Exception:
        pass
    t = time.perf_counter()
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # a peer revoked it first
    new = comm.Shrink()
    took = time.perf_counter() - t
    return float(max(new.allgather(took)))


def measure_bounds(plans: dict[str, Any], work: Path) -> dict[str, Any]:
    (work / "plans.json").write_text(json.dumps(plans))
    from resihp.trainer_hooks.launch.launcher import ULFM_FLAGS

    try:
        res = _mpirun(8, [str(Path(__file__).resolve()), "--bound-worker", str(work / "plans.json"),
                          str(work / "bound.json")], mpi_flags=ULFM_FLAGS, timeout=180.0)
        err = res.stderr
    except subprocess.TimeoutExpired as exc:  # the survivors of the killed rank wrote it, then mpirun hung
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
    if not (work / "bound.json").exists():  # the worker ends with a killed rank: judge by its output file
        raise RuntimeError(f"the bound measurement failed: {err[-2000:]}")
    return dict(json.loads((work / "bound.json").read_text()))


# --- fault-free candidate layouts on the healthy remaining ranks ------------------------------

def steps_per_s(progress: Path, skip: int = 5) -> float | None:
    rows = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()] if progress.exists() else []
    times = [float(r["time"]) for r in rows if r.get("type") == "step" and int(r["step"]) >= skip]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None


def candidate_rate(model: str, layout: tuple[int, int, int], steps: int, work: Path) -> float | None:
    tp, pp, dp = layout
    progress = work / f"{model}-tp{tp}pp{pp}dp{dp}.jsonl"
    progress.unlink(missing_ok=True)
    res = _mpirun(tp * pp * dp, [str(SCRIPTS[model]), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
                                 "--steps", str(steps), "--seq", str(SEQ), "--microbatches", str(MICROBATCHES),
                                 "--log-every", "1000000"], env={"RESIHP_PROGRESS": str(progress)})
    if res.returncode != 0:
        print(f"  ({model} TP{tp}xPP{pp}xDP{dp} failed: {res.stderr[-400:]})", file=sys.stderr)
        return None
    return steps_per_s(progress)


# --- one model's faulted run ------------------------------------------------------------------

def run_model(model: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    from resihp.demo import _parser as demo_parser
    from resihp.demo import run_job, run_reference
    from resihp.report.summary import summarize

    run = root / model
    run.mkdir(parents=True, exist_ok=True)
    args = demo_parser().parse_args(["--script", str(SCRIPTS[model]), "--seq", str(SEQ), "--steps", str(a.steps),
                                     "--slow-at", str(a.slow_at), "--kill-at", str(a.kill_at), "--quiet",
                                     "--microbatches", str(MICROBATCHES), "--run-dir", str(run)])
    info = run_job(args, run)
    (run / "demo.json").write_text(json.dumps(info))
    run_reference(args, run)
    summ = summarize(run).to_dict()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    targets = {str(ev["epoch"]): ev["plan"] for ev in events
               if ev.get("event") == "command" and ev.get("kind") == "reconfigure"}
    return {"summary": summ, "targets": targets, "info": info}


def numbers(model: str, got: dict[str, Any], bounds: dict[str, Any], rates: dict[str, float | None],
            steps: int) -> dict[str, Any]:
    summ = got["summary"]
    det = {d["kind"]: d for d in summ.get("detections", [])}
    worst = worst_recovery = None
    switches = []
    run_dir = Path(summ["run_dir"])
    progress = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines() if x.strip()]
    # the loss rank's seconds per phase of each switch (the progress log's ``phases_s``)
    phases = {int(r["epoch"]): r.get("phases_s", {}) for r in progress if r.get("type") == "reconfig"}
    for rc in summ.get("reconfigs", []):
        regroup = bounds["regroup_s"].get(f"{model}/{rc['epoch']}")
        if regroup is None:
            continue
        # a fail-stop must first shrink the MPI world (ULFM): measured once, added to its bound
        shrink = bounds.get("shrink_s", 0.0) if rc["kind"].startswith("fail-stop") else 0.0
        bound = rc["bytes_moved"] / bounds["loopback_Bps"] + regroup + shrink
        ratio = rc["downtime_s"] / bound
        ph = phases.get(int(rc["epoch"]), {})
        switches.append({"epoch": rc["epoch"], "kind": rc["kind"], "downtime_s": rc["downtime_s"],
                         "bytes_moved": rc["bytes_moved"], "bound_s": round(bound, 4), "over_bound": round(ratio, 2),
                         "phases_s": ph})
        worst = ratio if worst is None else max(worst, ratio)
        if "detect" in ph:  # a recovery: its downtime less the killed step's work and the wait to notice
            recovery = max(rc["downtime_s"] - ph["detect"], 0.0) / bound
            switches[-1]["recovery_over_bound"] = round(recovery, 2)
            worst_recovery = recovery if worst_recovery is None else max(worst_recovery, recovery)
    # each survivor logs "recovered in X s" (its own detection to ready); the progress log's
    # fail-stop downtime is longer: it runs from the last step's end, the killed step's work included
    recovered = [float(m.group(1)) for m in re.finditer(r"recovered in ([0-9.]+) s", (run_dir / "launch.log").read_text())]
    done = [int(r["step"]) for r in progress if r.get("type") == "step"]
    last_replan = max((float(r["time"]) for r in progress if r.get("type") == "reconfig"), default=None)
    after = [r for r in progress if r.get("type") == "step" and last_replan is not None and float(r["time"]) > last_replan]
    after_rate = (len(after) - 2) / (float(after[-1]["time"]) - float(after[1]["time"])) if len(after) > 3 else None
    best = max((v for v in rates.values() if v), default=None)
    return {
        "slow_detect_iters": det.get("slow", {}).get("latency_iters"),
        "stop_detect_s": round(det["kill"]["latency_s"], 3) if det.get("kill", {}).get("latency_s") is not None else None,
        "downtime_over_bound": round(worst, 2) if worst is not None else None,
        # the fail-stop's switch alone: its downtime from this rank's notice, not from the last
        # completed step (the killed step's work and noticing the kill are stop_detect_s's part)
        "failstop_recovery_over_bound": round(worst_recovery, 2) if worst_recovery is not None else None,
        "final_loss_rel_diff": summ.get("final_loss_rel_delta"),
        "steps_lost": steps - len(set(done) & set(range(steps))),
        "steps_redone": len(done) - len(set(done)),
        "throughput_retained_after_replan": round(after_rate / best, 3) if after_rate and best else None,
        "steps_per_s_after_replan": round(after_rate, 3) if after_rate else None,
        "best_healthy_steps_per_s": round(best, 3) if best else None,
        "candidates_steps_per_s": {k: (round(v, 3) if v else None) for k, v in rates.items()},
        "switches": switches,
        "failstop_recovery_s_max": max(recovered) if recovered else None,
        "final_plan": (summ.get("reconfigs") or [{}])[-1].get("plan"),
        "launch_rc": got["info"]["scenario"]["launch_rc"],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--bound-worker"]:
        bound_worker(Path(argv[1]), Path(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--slow-at", type=int, default=14)
    ap.add_argument("--kill-at", type=int, default=42)
    ap.add_argument("--models", default="nanogpt,llama",
                    help="comma-separated: nanogpt, llama, and gpt (resihp's own GPT, the same scenario, to compare)")
    ap.add_argument("--candidate-steps", type=int, default=25)
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args(argv)
    root = Path(a.out or tempfile.mkdtemp(prefix="resihp-your-model-")).resolve()
    models = [m for m in a.models.split(",") if m]
    runs = {m: run_model(m, a, root) for m in models}
    plans = {f"{m}/{e}": p for m, got in runs.items() for e, p in got["targets"].items()}
    bounds = measure_bounds(plans, root) if plans else {"loopback_Bps": 1.0, "regroup_s": {}}
    out: dict[str, Any] = {}
    for m in models:
        final = runs[m]["summary"].get("reconfigs", [])
        chosen = final[-1]["plan"] if final else ""
        rates = {f"TP{tp}xPP{pp}xDP{dp}": candidate_rate(m, (tp, pp, dp), a.candidate_steps, root)
                 for tp, pp, dp in CANDIDATES}
        out[m] = numbers(m, runs[m], bounds, rates, a.steps)
        out[m]["chosen_plan"] = chosen
    print(f"\nloopback {bounds['loopback_Bps'] / 1e9:.2f} GB/s; runs in {root}\n")
    keys = ("slow_detect_iters", "stop_detect_s", "downtime_over_bound", "failstop_recovery_over_bound",
            "final_loss_rel_diff", "steps_lost",
            "steps_redone", "throughput_retained_after_replan", "steps_per_s_after_replan", "best_healthy_steps_per_s")
    goals = {"slow_detect_iters": "<= 5", "stop_detect_s": "<= 3", "downtime_over_bound": "<= 2",
             "final_loss_rel_diff": "<= 1e-4", "steps_lost": "0"}
    print(f"{'metric':34s} {'goal':>8s} " + " ".join(f"{m:>12s}" for m in models))
    for k in keys:
        print(f"{k:34s} {goals.get(k, ''):>8s} " + " ".join(f"{str(out[m][k]):>12s}" for m in models))
    for m in models:
        print(f"\n{m}: final plan {out[m]['final_plan']}; switches:")
        for s in out[m]["switches"]:
            print(f"  epoch {s['epoch']} {s['kind']:9s} downtime {s['downtime_s']:.3f} s, {s['bytes_moved'] / 2**20:.2f} MiB, "
                  f"bound {s['bound_s']:.3f} s, x{s['over_bound']:.2f}"
                  + (f" (from the notice: x{s['recovery_over_bound']:.2f})" if "recovery_over_bound" in s else ""))
            if s.get("phases_s"):
                print("    " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in s["phases_s"].items()))
        print(f"  survivors' recovery, detection to ready (max): {out[m]['failstop_recovery_s_max']} s")
        print(f"  fault-free steps/s on the healthy remaining ranks: {out[m]['candidates_steps_per_s']}")
    print(json.dumps({"models": out, "loopback_Bps": round(bounds["loopback_Bps"]), "run_dir": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
