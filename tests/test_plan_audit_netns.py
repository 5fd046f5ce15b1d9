"""A re-plan that the model mispriced is measured, found slower, and undone — on a real slow link.

Four nodes (network namespaces), one rank each, TP1 × PP2 × DP2 (tests/netns_cluster.py).
At iteration ≥ 20 the fourth node's link is shaped to 100 Mbit/s with ``tc tbf`` (as in
tests/test_link_fault_netns.py), and re-planning is turned on (``resihp admin policy``). The
planner is made to price links from the demo's configured CPU profile (``profile=configured``:
2 GB/s, 0.8 ms), while a DP ring across this bridge takes several times that: for the
link-slow rank 3 it picks a layout whose DP ring still holds rank 3's link (measured: predicted
0.56 → 0.45 s, in fact 0.15 → 0.35 s per iteration). With the profile measured from the
job's own iterations (the default) it does not: tests/test_planner_profile_netns.py.
The coordinator's plan audit (coordinator/planner/audit.py) compares the new plan's measured
iterations with the old plan's since the finding, finds it slower by more than
``audit_margin`` and commands the previous layout back; the ranks switch live, training
every step once.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import read_jsonl, wait_until
from fresh_rerun import recording_fixtures
from netns_cluster import admin_status, cluster_or_skip, healthy_at, launch_four_node_job, stop

THROTTLE_AT = 20
# 100 Mbit/s, not less: the planner answers a finding of ~45x on rank 3's link (seen at 50
# Mbit/s on a CI machine) by leaving rank 3 out, a right answer with nothing to undo; at 100
# Mbit/s the finding reads 13-16x, it keeps rank 3 in a DP ring, and that ring measures
# 2.2-2.4x slower than the old layout (5 runs here)
THROTTLE_MBIT = 100
# re-planning starts off and is turned on just before the throttle: a noise finding on the
# shared cores before it would re-plan the healthy job and leave nothing to test
# shares=whole: with DP shares cut by the document the planner leaves rank 3 out altogether
# (three one-stage replicas, 4 micro-batches split evenly): a right answer, with nothing to undo
LINK_POLICY = ("--policy=links=on", "--policy=comm_threshold=2.0", "--policy=dp_threshold=1.0", "--policy=profile=configured",
               "--policy=shares=whole", "--no-auto-reconfigure")

pytestmark = pytest.mark.flaky(reruns=1)


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "progress.jsonl") if r["type"] == "step"]


def _undone(run: Path) -> list[dict[str, Any]] | None:
    """The commands, once the one that undoes the audited switch is acknowledged."""
    if not any(e.get("trigger") == "acked" and "epoch 2" in e["reason"] for e in _events(run, "state")):
        return None
    return _events(run, "command")


@contextmanager
def _recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One run of the scenario: the mispriced switch, its audit and the switch back."""
    work = tmp_path_factory.mktemp("audit")
    run = work / "run"
    with cluster_or_skip(work / "cluster", 4) as cluster:
        launch = launch_four_node_job(cluster, work, LINK_POLICY)
        try:
            at = wait_until(lambda: healthy_at(run, 3, THROTTLE_AT), 120, f"iteration {THROTTLE_AT} with rank 3 healthy")
            on = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "--run-dir", str(run), "policy",
                                 "auto_reconfigure=on"], capture_output=True, text=True, timeout=60)
            assert on.returncode == 0, on.stdout + on.stderr
            cluster.throttle_link(cluster.nodes[3], mbit=THROTTLE_MBIT)
            commands = wait_until(lambda: _undone(run), 150, "the audited switch undone and acknowledged")
            # an acknowledgement comes before the switch's step: train a step on the old layout again
            wait_until(lambda: _steps(run)[-1:] >= [commands[1]["apply_at"]] or None, 60, "a step after the undo")
            status = admin_status(run)
        finally:
            stop(launch)
        yield {"run": run, "throttled_at": at, "commands": commands, "status": status}


first_audited, audited = recording_fixtures(_recorded, "audited")  # a rerun judges a fresh run


def test_the_mispriced_replan_is_measured_slower_and_undone(audited: dict[str, Any]) -> None:
    run = audited["run"]
    first, back = audited["commands"][:2]
    # the planner's answer to a finding after the throttle — rank 3's link, its DP-ring partner's,
    # or (seen once) a noise finding on another rank and its recovery: the audit judges whatever
    # switch the planner made
    regret = re.match(r"regret: the re-plan for the (fail-slow|recovered) of ranks (\[[\d, ]+\]) measured slower: "
                      r"epoch 1 runs", back["reason"])
    assert regret is not None and back["epoch"] == 2, back
    kind, ranks = regret.groups()
    assert first["epoch"] == 1 and first["reason"].startswith(
        f"fail-slow of ranks {ranks}" if kind == "fail-slow" else f"ranks {ranks} recovered"), first
    assert first["plan"]["replicas"] != back["plan"]["replicas"]
    audit, = _events(run, "plan-audit")
    assert (audit["old_epoch"], audit["new_epoch"], audit["regret"], audit["outcome"]) == (0, 1, True, "undone"), audit
    assert audit["ratio"] > 1.2 and audit["after_s"] > 1.2 * audit["before_s"], audit
    # back to the job's own layout: PP2 x DP2, ranks (0, 1) and (2, 3)
    assert [r["stages"] for r in back["plan"]["replicas"]] == [[[0], [1]], [[2], [3]]], back["plan"]
    assert audited["status"]["epoch"] == 2 and audited["status"]["state"] == "RUNNING", audited["status"]
    kept = {r["rank"]: r["kept"] for r in audited["status"]["ranks"] if r["kept"]}
    assert str(sorted(kept)) == ranks and all(
        k.startswith(f"a {kind} keeps the layout: the re-plan for the {kind} of ranks {ranks}") for k in kept.values()), kept


def test_every_step_is_trained_once_through_both_switches(audited: dict[str, Any]) -> None:
    steps = _steps(audited["run"])
    assert steps == list(range(len(steps))) and len(steps) > audited["commands"][1]["apply_at"], steps[-5:]
    switches = [(r["epoch"], r["kind"]) for r in read_jsonl(audited["run"] / "progress.jsonl") if r["type"] == "reconfig"]
    assert switches == [(1, "planned"), (2, "planned")], switches
