"""examples/nanogpt: train.py stays train_plain.py plus resihp's few lines, and the plain script
trains, as one process and as a two-process torchrun DDP job."""
from __future__ import annotations

import difflib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "nanogpt"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# five iterations of the default tiny model on a 200 KB corpus; no evaluation
SMALL = ["--max_iters=5", "--log_interval=1", "--eval_interval=0", "--corpus_bytes=200000"]
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _unified_diff() -> list[str]:
    plain = (EXAMPLE / "train_plain.py").read_text().splitlines(keepends=True)
    hooked = (EXAMPLE / "train.py").read_text().splitlines(keepends=True)
    return list(difflib.unified_diff(plain, hooked, "train_plain.py", "train.py"))


def _run(cmd: list[str], timeout_s: float) -> str:
    # a torchrun or MPI environment around the test run must not turn the plain run into a DDP one
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _losses(out: str) -> tuple[list[float], float]:
    """The logged per-iteration losses and the final loss."""
    iters = [(int(i), float(v)) for i, v in re.findall(r"^iter (\d+): loss (\S+), time [\d.]+ms", out, re.M)]
    finals = re.findall(r"^final loss (\S+)$", out, re.M)
    assert len(finals) == 1, f"expected one 'final loss' line (the master's):\n{out}"
    assert [i for i, _ in iters] == list(range(5)), f"expected iterations 0..4 logged once each:\n{out}"
    return [v for _, v in iters], float(finals[0])


def test_train_py_is_train_plain_plus_the_hooks() -> None:
    diff = _unified_diff()
    added = [line for line in diff[2:] if line.startswith("+")]
    removed = [line for line in diff[2:] if line.startswith("-")]
    assert removed == [], f"train.py must only add lines to train_plain.py: {removed}"
    assert len(added) <= 4, f"train.py adds {len(added)} lines (at most 4): {added}"
    text = "".join(added)
    assert "import resihp.trainer_hooks as resihp_hooks" in text
    assert "resihp_hooks.init(model=raw_model)" in text and "job.step(" in text
    # the README shows the diff as it is
    assert "".join(diff) in (EXAMPLE / "README.md").read_text(), "examples/nanogpt/README.md shows a stale diff"


def test_train_plain_single_process() -> None:
    out = _run([sys.executable, str(EXAMPLE / "train_plain.py"), *SMALL], timeout_s=120)
    assert "tokens per iteration will be: 1,024" in out
    losses, final = _losses(out)
    assert math.isfinite(final) and final == pytest.approx(losses[-1], abs=1e-4)
    # it learns: from about ln(256) = 5.55 at initialisation, down within five small warm-up steps
    assert 5.0 < losses[0] < 6.0 and final < losses[0], out


# After its last iteration and destroy_process_group(), a rank of the plain DDP job sometimes
# aborts in torch's own teardown ("terminate called without an active exception", SIGABRT):
# once in a CI run, 1 in 20 here beside a busy loop, 0 in 8 without. Its training is whole by
# then (the final loss is printed); a rerun asks the same of a fresh job.
@pytest.mark.flaky(reruns=2)
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no {TORCHRUN}")
def test_train_plain_under_torchrun_ddp() -> None:
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(EXAMPLE / "train_plain.py"), *SMALL]
    out = _run(cmd, timeout_s=180)
    # both ranks parsed the overrides; only the master (RANK 0) logs and prints the final loss
    assert out.count("Overriding: max_iters = 5") == 2, out
    assert out.count("tokens per iteration will be: 1,024") == 1, out
    losses, final = _losses(out)
    assert math.isfinite(final) and final == pytest.approx(losses[-1], abs=1e-4)
    assert 5.0 < losses[0] < 6.0, out
