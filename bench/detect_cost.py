"""bench/detect.py's cost measurements: the detector's online CPU time per iteration at 256 and
4,096 ranks (LLaMA-2-70B, TP 8 x PP 8), per heartbeat of a trace replayed with its heartbeats
(``resihp detect``), and the coordinator's cost per compute probe at 16,384 ranks. CPU time of this process: on a shared machine compare the two sizes within one run.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from resihp.coordinator.detector.detector import Detector, DetectorConfig
from resihp.coordinator.detector.evidence import timings_from_record
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import preset
from resihp.coordinator.model.trace import DeviceInfo, HeartbeatEvent, IterationRecord, TraceHeader
from resihp.sim.workload import Noise, WorkloadConfig, generate, make_header
from resihp.sim.workload_truth import GroundTruth, to_record

WARMUP_COST: dict[int, float] = {}  # ranks -> CPU ms per iteration while the detector warms up


def time_detector(ranks_target: int, detector: DetectorConfig) -> tuple[float, float, float]:
    """Online cost of the detector per iteration at ``ranks_target`` ranks (LLaMA-2-70B,
    TP 8 x PP 8 x DP n, 8 micro-batches per replica): (CPU ms, wall ms) per iteration, mean
    over 32 post-warm-up iterations including the periodic calibration and the noise model's
    refreshes (the warm-up's mean goes to WARMUP_COST); plus the ms it
    takes to turn one trace record into arrays (not part of the online cost: the
    coordinator's aggregator fills the arrays as reports arrive)."""
    model = preset("llama2-70b")
    dp = ranks_target // 64
    plan = Plan.uniform(8, 8, dp, model.num_layers, 8 * dp)
    cfg = WorkloadConfig(model, plan, budget=32768, seed=7, iterations=16, heartbeats=False)
    truth = GroundTruth(cfg)
    det = Detector(make_header(cfg), replace(detector, warmup_iters=8))
    timings = []
    t0 = 0.0
    for it in range(13):
        t = truth.timings(it, t0)
        t0 += t.time_s
        timings.append(t)
    rec = to_record(timings[-1], truth)
    conv_t = time.perf_counter()
    timings_from_record(rec, det.index)
    conv_ms = (time.perf_counter() - conv_t) * 1000
    for t in timings[:9]:
        det.observe_timings(t, t.start_s + t.time_s)
    cpu, wall = [], []
    # fresh iteration numbers, so every calib_every-th one calibrates; the adaptive detector's
    # keys learn their first samples (a refresh on every other one) until detector.judged_from + 8
    steady_from = detector.judged_from + 8 - 9
    for k in range(steady_from + 32):
        t = replace(timings[9 + k % 4], iteration=9 + k)
        c, w = time.process_time(), time.perf_counter()
        det.observe_timings(t, t.start_s + t.time_s)
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
    WARMUP_COST[ranks_target] = float(np.mean(cpu[:steady_from]))
    return float(np.mean(cpu[steady_from:])), float(np.mean(wall[steady_from:])), conv_ms


def time_probes(ranks_target: int, spares: int = 32) -> tuple[float, float]:
    """Coordinator CPU cost of compute probes at ``ranks_target`` ranks (LLaMA-2-70B, TP 8 x
    PP 4): (µs per start-up probe of a rank of the plan, ms per judged probe of an idle
    rank). Every rank probes at start-up, thousands at once; idle ranks every 30 s."""
    model = preset("llama2-70b")
    dp = ranks_target // 32
    plan = Plan.uniform(8, 4, dp, model.num_layers, 4 * dp)
    header = TraceHeader(model, plan, tuple(DeviceInfo(r, f"node{r // 8}", r % 8) for r in range(ranks_target)),
                         job="probe-cost")
    det = Detector(header)
    c = time.process_time()
    for r in range(ranks_target):
        det.observe_probe(r, 0.010 + 1e-5 * (r % 7), now=1.0)
    startup_us = (time.process_time() - c) / ranks_target * 1e6
    smaller = Plan.uniform(8, 4, dp - 1, model.num_layers, 4 * (dp - 1))
    det.set_plan(replace(smaller, spares=tuple(range(ranks_target - 32, ranks_target)), epoch=1))
    c = time.process_time()
    for i in range(spares):
        det.observe_probe(ranks_target - 32 + i % 32, 0.010, now=2.0 + i)
    idle_ms = (time.process_time() - c) / spares * 1e3
    return startup_us, idle_ms


def time_heartbeats(ranks_target: int, iterations: int = 4) -> float:
    """CPU µs per heartbeat event of a trace replayed with its heartbeats, as ``resihp detect``
    replays one (``observe`` then ``tick`` per record; LLaMA-2-70B, TP 8 x PP 8 x DP n, every
    noise class on): a job of n ranks beats n times per second, so at 1,024 ranks 1 ms per
    beat is a second of CPU per second of trace."""
    model = preset("llama2-70b")
    dp = ranks_target // 64
    plan = Plan.uniform(8, 8, dp, model.num_layers, 16 * dp)
    cfg = WorkloadConfig(model, plan, budget=8192, seed=1, iterations=iterations, heartbeats=True,
                         noise=Noise.everything())
    records = list(generate(cfg))
    det = Detector(make_header(cfg))
    spent, beats = 0.0, 0
    for rec in records:
        now = rec.start_s + rec.time_s if isinstance(rec, IterationRecord) else rec.time_s
        c = time.process_time()
        det.observe(rec, now)
        det.tick(now)
        if isinstance(rec, HeartbeatEvent):
            spent += time.process_time() - c
            beats += 1
    return spent / max(1, beats) * 1e6
