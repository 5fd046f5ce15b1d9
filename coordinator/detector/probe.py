"""Judging idle ranks by probes.

A rank the plan leaves idle (a spare, or one excluded for being slow) runs no iteration, so
nothing the detector normally reads can say whether its device is slow or healthy. Instead,
every ``probe_every_s`` an idle rank times a short fixed compute probe (a few GEMMs on its
device, stretched by the same throttle as its compute chunks; ``trainer_hooks/runtime/probe.py``)
and reports the duration. Every rank also probes once at start-up, which gives the
healthy reference: the median of the latest probe of every *other* rank not judged slow or
dead. The probe's ratio to that reference is judged like a step's: ``confirm_iters``
consecutive probes above ``1 + probe_threshold`` make an idle healthy rank slow (a
fail-slow finding, so the planner will not take it back as healthy), ``recover_iters``
consecutive probes at or below it make an idle slow rank recovered (a recovered finding,
so the planner may take it back), and every slow probe renews the slow verdict, so it does
not lapse (``spare_verdict_s``) while the evidence says it is still slow.

A probe measures compute only: the verdict of a rank slow because of its links is left to
the lapse. Pure: numpy only, no torch, grpc or MPI; ``ProbeBook`` only keeps numbers.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from resihp.coordinator.detector.config import DetectorConfig

ProbeAction = Literal["none", "renew", "recovered", "fail-slow"]


@dataclass(frozen=True)
class ProbeReading:
    """One probe set against the reference: ``ratio`` None when no reference exists yet."""

    rank: int
    probe_s: float
    reference_s: float | None
    ratio: float | None


def check_probe(rank: int, probe_s: float, known: Collection[int]) -> None:
    """Refuse a probe no judgement can use, saying what was wrong (``known``: the job's ranks)."""
    if rank not in known:
        raise ValueError(f"probe from rank {rank}: not a rank of this job (ranks {min(known)}..{max(known)}); "
                         "check the trainer's rank")
    if not (isinstance(probe_s, (int, float)) and math.isfinite(probe_s) and probe_s > 0):
        raise ValueError(f"probe from rank {rank}: probe_s must be a finite duration > 0 seconds, got {probe_s!r}")


def is_slow_probe(ratio: float, config: DetectorConfig) -> bool:
    return ratio > 1.0 + config.probe_threshold


def judge_probe(was_slow: bool, slow_probe: bool, run: int, config: DetectorConfig) -> ProbeAction:
    """What one probe of an idle rank does. ``was_slow``: the rank's verdict before it;
    ``run``: its probes in a row of this probe's kind (slow or normal), this one included.
    The detector and the simulator's resihp both decide with this."""
    if was_slow:
        if slow_probe:
            return "renew"  # still slow: the evidence renews the verdict
        return "recovered" if run >= config.recover_iters else "none"
    return "fail-slow" if slow_probe and run >= config.confirm_iters else "none"


@dataclass
class ProbeBook:
    """The latest probe of every rank and, per idle rank, its current run of slow or
    normal probes (reset when the plan uses the rank)."""

    latest: dict[int, float] = field(default_factory=dict)
    slow_run: dict[int, int] = field(default_factory=dict)
    ok_run: dict[int, int] = field(default_factory=dict)

    def record(self, rank: int, probe_s: float) -> None:
        """Keep a probe of a rank its iterations judge: reference only, no run counted."""
        self.latest[rank] = float(probe_s)
        self.forget_runs(rank)

    def read(self, rank: int, probe_s: float, unreliable: set[int]) -> ProbeReading:
        """Record ``probe_s`` and set it against the other ranks' latest probes, leaving out
        ``unreliable`` ones (judged slow or dead): their probes do not say what healthy is."""
        skip = unreliable | {rank}
        others = np.fromiter((v for r, v in self.latest.items() if r not in skip), dtype=np.float64)
        self.latest[rank] = float(probe_s)
        if not others.size:
            return ProbeReading(rank, float(probe_s), None, None)
        ref = float(np.median(others))
        return ProbeReading(rank, float(probe_s), ref, float(probe_s) / ref)

    def ratios(self, unreliable: set[int]) -> dict[int, float]:
        """Every rank's latest probe over the median latest probe of the reliable ranks."""
        ref = np.fromiter((v for r, v in self.latest.items() if r not in unreliable), dtype=np.float64)
        if not ref.size:
            return {}
        median = float(np.median(ref))
        return {r: v / median for r, v in self.latest.items()}

    def count(self, rank: int, slow: bool) -> int:
        """Extend the rank's run of slow (or normal) probes; returns its length. (The
        simulator keys runs by fault id instead of rank.)"""
        grow, reset = (self.slow_run, self.ok_run) if slow else (self.ok_run, self.slow_run)
        reset.pop(rank, None)
        grow[rank] = grow.get(rank, 0) + 1
        return grow[rank]

    def forget_runs(self, rank: int) -> None:
        self.slow_run.pop(rank, None)
        self.ok_run.pop(rank, None)
