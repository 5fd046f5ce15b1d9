"""Fault injection at an op of a step (trainer_hooks/faults.py): parsing, when it fires, and a
real process it stops."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resihp.trainer_hooks.faults import Fault, due, parse_fault


def test_a_fault_spec_is_parsed_or_refused_with_what_is_wrong() -> None:
    assert parse_fault("kill:5:10:DP all-reduce") == Fault("kill", 5, 10, "DP all-reduce")
    assert parse_fault("stop:0:3") == Fault("stop", 0, 3, "")
    for bad, why in (("boom:1:2", "ACTION one of"), ("kill:x:2", "must be integers"), ("kill:1", "expected"),
                     ("kill:-1:2", ">= 0")):
        with pytest.raises(ValueError, match=why):
            parse_fault(bad)


def test_a_fault_fires_from_its_step_on_and_only_inside_its_op() -> None:
    f = Fault("kill", 1, 10, "B")
    assert not due(f, 9, (4, "compute", "B mb0", False))
    assert due(f, 10, (4, "compute", "B mb0", False))
    assert not due(f, 10, (4, "compute", "B mb0", True))  # the op is over
    assert not due(f, 12, (5, "compute", "F mb1", False))
    assert due(Fault("stop", 1, 3), 3, (0, "", "", True))


def test_a_rank_stops_itself_inside_the_named_op_and_records_when(tmp_path: Path) -> None:
    code = (
        "import time\n"
        "from resihp.trainer_hooks.faults import arm_from_env\n"
        "from resihp.trainer_hooks.reporting.opcursor import CURSOR\n"
        "step = [0]\n"
        "arm_from_env(2, lambda: step[0])\n"
        "for step[0] in range(5):\n"
        "    with CURSOR.op('compute', 'F mb0'):\n"
        "        time.sleep(0.01)\n"
        "    with CURSOR.op('compute', 'optimizer step'):\n"
        "        time.sleep(0.05)\n"
        "print('never stopped')\n"
    )
    env = {**os.environ, "RESIHP_FAULT": "kill:2:3:optimizer", "RESIHP_RUN_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -9 and "never stopped" not in done.stdout
    rec = json.loads((tmp_path / "faults.jsonl").read_text())
    assert rec["step"] == 3 and rec["op"] == "optimizer step" and rec["action"] == "kill"
