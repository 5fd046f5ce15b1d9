"""The detector's options (``DetectorConfig``): thresholds, persistence, calibration,
and the evidence it judges. Every option is validated with a message that names it;
``docs/detector.md`` has the table. Pure: no torch, grpc or MPI."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds are relative excess of observed over predicted time."""

    slow_threshold: float = 0.05  # compute: median op ratio above 1.05 makes a suspect
    comm_threshold: float = 0.05  # links: smallest P2P ratio over the rank's cross-node directions
    dp_threshold: float = 0.20  # a DP ring alone (one noisy all-reduce per iteration)
    step_threshold: float = 0.06  # rank_step_s evidence
    iteration_threshold: float = 0.10  # iteration-time-only evidence
    # an idle rank's compute probe against the other ranks' probes (coordinator/detector/probe.py): above
    # 1 + this is a slow probe, at or below it a normal one
    probe_threshold: float = 0.10
    confirm_iters: int = 2  # consecutive suspect iterations that make a finding
    recover_threshold: float = 0.03  # below this excess an iteration counts as normal again
    recover_iters: int = 3
    warmup_iters: int = 8  # healthy iterations the cost model sees before judging any
    refit_every: int = 100  # iterations between refit rounds of the cost model (one key per iteration)
    calib_every: int = 4  # after warm-up, learn from every calib_every-th iteration
    # the predicted iteration's pause gap (seeds.PauseShare) learns from every n-th judged
    # iteration (one schedule simulation each; 0 = only when a finding or a caller asks)
    pause_every: int = 4
    calib_window: int = 192  # samples kept per cost key
    calib_samples_per_key: int = 4  # TP groups sampled per key from each calibrating post-warm-up iteration
    # learning iterations of a key whose work changed with a plan change. 8 as warmup_iters: even
    # at one micro-batch per iteration that is min_samples, and one odd iteration is 1/8 of a robust fit
    rewarm_iters: int = 8
    heartbeat_timeout_s: float = 30.0
    # no progress (no iteration) for max(hang_iters x the iteration's usual time, hang_floor_s):
    # a rank whose heartbeats stopped while its peers' go on holds the job up (SIGSTOP, a frozen
    # host) and is declared fail-stop, cause no-progress, long before heartbeat_timeout_s
    hang_iters: float = 2.0
    # 2 s, not 1: a no-progress verdict is fenced (the rank is killed), and on hosts loaded
    # far beyond their cores (4-5 runnable processes per core) a healthy rank's heartbeat
    # thread was starved for 1.3 s and killed, taking the only copy of its state with it
    hang_floor_s: float = 2.0
    # how long the slow verdict of a rank a re-plan left out stands when nothing observes it (a
    # rank that does not probe, or one slow because of its links): Greyhound's mean compute
    # fail-slow lasts 10 minutes. After it the next re-plan may use the rank again and its
    # timings judge it afresh; a slow probe renews the verdict; `resihp admin readmit` ends it
    spare_verdict_s: float = 600.0
    # False: judge compute only. For jobs whose P2P timings include waiting for the sender
    # (CPU / gloo over loopback): a slow rank's neighbours would otherwise look link-slow
    link_detection: bool = True
    # judge compute against the iteration's peers where they all run faster than the model
    # predicts: on shared CPUs a throttled rank hands its share of the cores to its peers,
    # so the calibration (made while all competed) flatters everyone else and the sick rank
    # shows only part of its slowdown (docs/detector.md, "Peer-relative compute")
    peer_relative: bool = False
    # with peer_relative, also divide away a slowdown common to the peers: on a shared host
    # co-tenant load slows every rank at once, which no re-plan can route around
    peer_common_slowdown: bool = False

    # a fail-slow finding whose predicted cost (seconds per iteration the job loses to it, from
    # the schedule simulation, over the healthy iteration) is below this share is `degraded`:
    # logged and counted, but no re-plan is asked for (moving state costs more than it saves)
    impact_floor: float = 0.01
    # noise-adaptive judging (coordinator/detector/noise.py), the default: each rank's compute and
    # link ratios are judged against their own healthy median and spread, relative to the
    # iteration's peers, by a multi-scale shift test. False: the fixed thresholds above, for
    # consecutive iterations — quick on a quiet, well-calibrated cluster, but on shared hosts and
    # busy fabrics (spans that swing by tens of per cent) a source of false alarms
    adaptive: bool = True
    # a compute slowdown found within the iteration it slows, from the op states the heartbeats
    # carry (coordinator/detector/inflight.py): for long iterations, where waiting for the
    # second slowed iteration's record costs minutes
    in_flight: bool = True
    # ... for jobs whose usual iteration lasts at least this long: a shorter one's records find a
    # slowdown within seconds, and on shared CPU hosts a sub-second iteration swings by multiples
    in_flight_min_iteration_s: float = 5.0
    # a slow rank whose slowdown has since moved by at least this share (both halves of its
    # latest factor_drift_iters ratios against the factor last reported: 2.1x -> 3x, or 3x ->
    # 1.5x) is reported again with its factor now, so the planner can size its work anew
    # (coordinator/detector/drift.py; 0 = never)
    factor_drift: float = 0.3
    factor_drift_iters: int = 8
    noise_level: float = 6.0  # the shift test's level, in spreads of a √w-window mean
    noise_window: int = 64  # healthy ratios kept per key
    noise_clip: float = 3.0  # one iteration moves the test by at most this many spreads
    effect_floor: float = 0.05  # and the crossing window's mean excess must be above this
    prior_spread: float = 0.10  # a key's relative spread until it has measured its own
    min_spread: float = 0.01  # a key's spread is never taken below this (relative)
    noise_min_samples: int = 8  # healthy ratios a key learns after warm-up before it is judged

    @property
    def judged_from(self) -> int:
        """Iterations a job runs before the detector can find a fail-slow: the cost model's
        warm-up, then, adaptive, the healthy samples every key learns first."""
        return self.warmup_iters + (self.noise_min_samples if self.adaptive else 0)

    def __post_init__(self) -> None:
        for name in ("slow_threshold", "comm_threshold", "dp_threshold", "step_threshold", "iteration_threshold",
                     "probe_threshold"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v < 10):
                raise ValueError(f"DetectorConfig.{name} must be a relative excess in (0, 10), e.g. 0.05 for 5 %; got {v!r}")
        if not (0 <= self.recover_threshold <= self.slow_threshold):
            raise ValueError(
                f"DetectorConfig.recover_threshold ({self.recover_threshold}) must be in [0, slow_threshold "
                f"({self.slow_threshold})]: a rank cannot count as recovered while it still looks slow"
            )
        for name in ("confirm_iters", "recover_iters", "warmup_iters", "refit_every", "calib_every",
                     "calib_samples_per_key", "rewarm_iters", "noise_min_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DetectorConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.pause_every, int) or isinstance(self.pause_every, bool) or self.pause_every < 0:
            raise ValueError(f"DetectorConfig.pause_every must be an integer >= 0 (0: learn only when asked), got "
                             f"{self.pause_every!r}")
        for name, lo, hi in (("impact_floor", 0.0, 1.0), ("in_flight_min_iteration_s", 0.0, 86400.0), ("factor_drift", 0.0, 10.0), ("hang_iters", 1.0, 1000.0), ("hang_floor_s", 0.0, 3600.0), ("noise_level", 1.0, 100.0), ("noise_clip", 1.0, 100.0), ("effect_floor", 0.0, 10.0),
                             ("prior_spread", 1e-4, 10.0), ("min_spread", 0.0, 10.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"DetectorConfig.{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        if not isinstance(self.factor_drift_iters, int) or isinstance(self.factor_drift_iters, bool) or \
                self.factor_drift_iters < 2:
            raise ValueError(f"DetectorConfig.factor_drift_iters must be an integer >= 2 (a window of two halves), got "
                             f"{self.factor_drift_iters!r}")
        if not isinstance(self.noise_window, int) or isinstance(self.noise_window, bool) or self.noise_window < 16:
            raise ValueError(f"DetectorConfig.noise_window must be an integer >= 16, got {self.noise_window!r}")
        for name in ("link_detection", "peer_relative", "peer_common_slowdown", "adaptive", "in_flight"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DetectorConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.peer_common_slowdown and not self.peer_relative:
            raise ValueError("DetectorConfig.peer_common_slowdown needs peer_relative: it changes how compute is "
                             "judged against the peers; turn both on, or both off")
        if not isinstance(self.calib_window, int) or self.calib_window < 16:
            raise ValueError(f"DetectorConfig.calib_window must be an integer >= 16, got {self.calib_window!r}")
        if not (isinstance(self.spare_verdict_s, (int, float)) and self.spare_verdict_s > 0):
            raise ValueError(f"DetectorConfig.spare_verdict_s must be > 0 seconds, got {self.spare_verdict_s!r}")
        if not (math.isfinite(self.heartbeat_timeout_s) and self.heartbeat_timeout_s > 0):
            raise ValueError(f"DetectorConfig.heartbeat_timeout_s must be > 0 seconds, got {self.heartbeat_timeout_s!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DetectorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"DetectorConfig: unknown option(s) {unknown}; known options are {sorted(known)}")
        return cls(**dict(data))
