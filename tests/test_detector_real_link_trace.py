"""The fixed-threshold detector on real traces: a link shaped, then cleared.

Both were recorded by ``tests/test_link_fault_netns.py`` (four network-namespace nodes on this
machine's two cores, TP1 × PP2 × DP2 of gpt-tiny, rank 3's link shaped to 50 Mbit/s with
``tc tbf`` once it is healthy and cleared after the finding), the coordinator running the
demo's CPU policy with link detection on:

- ``link_shaped_then_cleared``: with a busy loop on one of the two cores. Iterations run at
  0.28-0.33 s while the shaper is on (29-31), 0.11-0.16 s from 32; afterwards every transfer
  has a heavy tail (P2P 1-11x its prediction, the DP ring 0-3.5x, compute 1-2.7x per iteration).
- ``link_shaped_then_cleared_skewed_ring``: no other load. Shaped 25-29; rank 3's DP ring read
  0-9.8x the model in healthy iterations (median ~2: its own entry skew), before and after.
"""
from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import pytest

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.trace import IterationRecord, read_trace
from resihp.demo import CPU_POLICY

DATA = Path(__file__).parent / "data"
LINK_POLICY = ("links=on", "comm_threshold=2.0", "dp_threshold=1.0")  # as test_link_fault_netns runs it
# each trace with the last iteration that ran at the shaped speed
TRACES = [("link_shaped_then_cleared", 31), ("link_shaped_then_cleared_skewed_ring", 29)]


def _config(policy: tuple[str, ...]) -> DetectorConfig:
    """The DetectorConfig the coordinator's ``--policy`` entries give (key=value, on/off)."""
    fields = {f.name: f for f in dataclasses.fields(DetectorConfig)}
    values: dict[str, object] = {}
    for entry in policy:
        key, value = entry.split("=")
        key = "link_detection" if key == "links" else key
        kind = type(getattr(DetectorConfig(), fields[key].name))
        values[key] = value == "on" if kind is bool else kind(float(value))
    return dataclasses.replace(DetectorConfig(), **values)


def _findings_on_rank_3(name: str) -> list[Finding]:
    with gzip.open(DATA / f"{name}.trace.jsonl.gz", "rt", encoding="utf-8") as fh:
        header, records = read_trace(fh)
        det = Detector(header, _config(CPU_POLICY + LINK_POLICY))
        found: list[Finding] = []
        for rec in records:
            now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else getattr(rec, "time_s", 0.0)
            found += det.observe(rec, now) + det.tick(now)
    return [f for f in found if f.ranks == (3,) and f.cause == "communication"]


def test_the_policy_is_the_fixed_threshold_one_the_trace_ran_under() -> None:
    cfg = _config(CPU_POLICY + LINK_POLICY)
    assert (cfg.adaptive, cfg.link_detection, cfg.comm_threshold, cfg.dp_threshold) == (False, True, 2.0, 1.0)


@pytest.mark.parametrize(("name", "last_shaped"), TRACES)
def test_the_shaped_link_is_found_and_recovered_soon_after_the_shaper_is_gone(name: str, last_shaped: int) -> None:
    found = _findings_on_rank_3(name)
    kinds = [(f.kind, f.iteration) for f in found]
    slow, back = found[0], found[1]
    assert slow.kind == "fail-slow" and slow.iteration <= last_shaped and slow.factor > 8.0, kinds
    # recovery judges the median of the last 2·recover_iters − 1 iterations, the ring against
    # its own healthy level: it needs most of that window after the shaper and then
    # recover_iters normal iterations (36 and 35 here). Each iteration's own evidence within
    # the fixed thresholds, recover_iters in a row, took until 48 and 43
    assert back.kind == "recovered" and last_shaped < back.iteration <= last_shaped + 8, kinds


def test_the_recovery_window_reads_medians_and_the_ring_level_taken_as_the_rank_turned_suspect() -> None:
    import numpy as np

    from resihp.coordinator.detector.recovery_window import RecoveryWindow

    win = RecoveryWindow(5, 2)
    no, slow0 = np.zeros(2, dtype=bool), np.array([True, False])
    for ring in (2.0, 2.1, 1.9, 2.0):  # a healthy ring reading ~2x the model
        win.push(np.ones(2), np.ones(2), np.array([ring, 1.0]), no, no)
    win.push(np.ones(2), np.ones(2), np.array([40.0, 1.0]), no, slow0)  # rank 0 turns suspect here
    assert win.ring_back_below(1.0).tolist() == [4.0, 2.0]  # 2x its level of 2.0; rank 1: none, the model's
    # once rank 0 is link-slow: one far-out link reading among back ones does not hold it
    for link in (1.2, 11.0, 1.1):
        comp, comm, dp = win.push(np.ones(2), np.array([link, 7.0]), np.array([1.5, 1.0]), slow0, no)
    # rank 0: the median of its last five (1, 1, 1.2, 11, 1.1) and (2.0, 40, 1.5, 1.5, 1.5); rank 1: as read
    assert comm.tolist() == [1.1, 7.0] and dp.tolist() == [1.5, 1.0]
