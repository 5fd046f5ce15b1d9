"""A user's model split over TP 2 on two real gloo processes computes what the unsharded model
computes: logits, loss and every gradient (each rank's shard against the same slice of the
unsharded model's gradient), for nanoGPT, a Hugging Face Llama and four other Hugging Face
families read from their declared plans (packed: two documents in one row, against each
document run alone)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from usermodel_models import HF_FAMILIES, MODELS

WORKER = Path(__file__).with_name("_usermodel_tp_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("model", MODELS + HF_FAMILIES)
def test_tp2_forward_and_backward_equal_the_unsharded_model(model: str, tmp_path: Path) -> None:
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), model, str(tmp_path / f"{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for r in range(2):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["logits"] < 1e-5, (r, got["logits"])
        assert got["loss"] < 1e-5, (r, got["loss"])
        worst = max(got["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-4, (r, worst)
        assert len(got["split"]) >= 4 * 4, "every block's planned layers are split"
