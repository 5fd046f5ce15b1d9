"""The planner priced with the profile measured from the job's own iterations — on a real slow link.

The scenario of tests/test_plan_audit_netns.py (four nodes in network namespaces, TP1 × PP2
× DP2, the fourth node's link shaped to 50 Mbit/s at iteration ≥ 20, re-planning turned on
just before), with the default ``profile=measured``: the planner's device FLOP/s and link
speed come from the healthy iterations before the throttle (coordinator/planner/profile.py).
Priced from the configured CPU profile, the planner answers the slow link with DP4, which
runs 2.1–2.6× slower and is undone; priced from the measured one, its answer must run
faster than the job did on the slow link, and the plan audit keeps it.
"""
from __future__ import annotations

import re
import statistics
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
LINK_POLICY = ("--policy=links=on", "--policy=comm_threshold=2.0", "--policy=dp_threshold=1.0", "--no-auto-reconfigure")

pytestmark = pytest.mark.flaky(reruns=1)


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def _audited(run: Path) -> list[dict[str, Any]] | None:
    return _events(run, "plan-audit") or None


@contextmanager
def _recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One run of the scenario: the slow link, the planner's switch and its audit."""
    work = tmp_path_factory.mktemp("profile")
    run = work / "run"
    with cluster_or_skip(work / "cluster", 4) as cluster:
        launch = launch_four_node_job(cluster, work, LINK_POLICY)
        try:
            at = wait_until(lambda: healthy_at(run, 3, THROTTLE_AT), 120, f"iteration {THROTTLE_AT} with rank 3 healthy")
            before = admin_status(run)
            on = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "--run-dir", str(run), "policy",
                                 "auto_reconfigure=on"], capture_output=True, text=True, timeout=60)
            assert on.returncode == 0, on.stdout + on.stderr
            cluster.throttle_link(cluster.nodes[3], mbit=50)
            audits = wait_until(lambda: _audited(run), 150, "the planner's switch after the throttle audited")
            text = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "--run-dir", str(run), "status"],
                                  capture_output=True, text=True, timeout=60)
        finally:
            stop(launch)
        yield {"run": run, "throttled_at": at, "before": before, "audits": audits, "status_text": text.stdout}


first_measured, measured = recording_fixtures(_recorded, "measured")  # a rerun judges a fresh run


def _slow_link_s(run: Path, throttled_at: int) -> float:
    """Median iteration time of the initial plan on the slow link: after the iteration the
    shaper went on at, before the first switch (the trace's first plan record)."""
    records = read_jsonl(run / "trace.jsonl")
    switch = min(r["iteration"] for r in records if r["type"] == "plan" and r["plan"]["epoch"] > 0)
    times = [r["time_s"] for r in records if r["type"] == "iteration" and throttled_at < r["iteration"] < switch]
    assert times, (throttled_at, switch)
    return statistics.median(times)


def test_the_switch_priced_on_the_measured_profile_runs_faster_and_is_kept(measured: dict[str, Any]) -> None:
    run = measured["run"]
    # the first audited switch: usually epoch 0 -> 1; when a second finding (the slow link's ring
    # partner) is answered before epoch 1 has run its audit window, that audit is superseded and
    # epoch 1 -> 2 is the first judged; either way it answers the slow link and must be kept
    audit = measured["audits"][0]
    assert (audit["new_epoch"], audit["regret"], audit["outcome"]) == (audit["old_epoch"] + 1, False, "kept"), audit
    # faster than the job ran on the slow link before any switch
    slow = _slow_link_s(run, measured["throttled_at"])
    assert audit["after_s"] < slow, (audit, slow)
    command = _events(run, "command")[0]
    assert command["epoch"] == 1
    # the decision says what priced it: the profile of the healthy iterations before the throttle
    priced = re.search(r"\[profile measured over (\d+) healthy iterations: ([\d.]+) GFLOP/s, links ([\d.]+) MB/s",
                       command["reason"])
    assert priced is not None, command["reason"]
    iterations, gflops, link_mbs = int(priced.group(1)), float(priced.group(2)), float(priced.group(3))
    assert iterations >= 8
    # gpt-tiny on one shared CPU core per rank, fp32 (the profile counts the planner's bf16
    # bytes): a few GFLOP/s, and a veth bridge far below the configured 2 GB/s
    assert 0.5 < gflops < 100 and 1 < link_mbs < 1000, command["reason"]
    # no regret and nothing commanded back to the slow layout
    assert not [e for e in _events(run, "state") if e.get("trigger") == "regret"]


def test_admin_status_says_what_prices_the_plans(measured: dict[str, Any]) -> None:
    assert re.match(r"measured over \d+ healthy iterations: [\d.]+ GFLOP/s, links", measured["before"]["planner_profile"])
    assert measured["before"]["policy"]["profile"] == "measured"
    assert "planner profile: measured over " in measured["status_text"], measured["status_text"]
