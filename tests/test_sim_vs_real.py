"""bench/sim_vs_real.py's pure parts: calibration from a reference run, prediction through
the simulator's perf model, MAPE (bench/sim_calibration.py), the reduction of the real runs'
records, and the errors for bad measurements (no mpirun here)."""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sim_calibration as simcal  # noqa: E402
import sim_vs_real as svr  # noqa: E402

from resihp.coordinator.model.spec import SpecError, preset  # noqa: E402
from resihp.sim.perf import JobSpec, PerfModel  # noqa: E402
from resihp.sim.world import World  # noqa: E402

SPEC = preset("gpt-tiny")
DOCS = (64, 40, 24)  # one micro-batch's packed documents (128 tokens)
RATE = 8e9  # the synthetic machine's FLOP/s
BW, LAT = 2e9, 100e-6
PING = [(float(b), LAT + b / BW) for b in svr.PING_BYTES]


def reference_chunks(steps: int = 3) -> list[tuple[str, tuple[int, ...], float]]:
    """A single-rank run on a machine that computes at exactly RATE."""
    f, b = simcal.microbatch_flops(SPEC, DOCS, SPEC.num_layers, 1, True, True)
    return [(k, DOCS, fl / RATE) for _ in range(steps * 8) for k, fl in (("F", f), ("B", b))]


def test_fit_link_recovers_bandwidth_and_latency() -> None:
    bw, lat = simcal.fit_link(PING)
    assert bw == pytest.approx(BW, rel=1e-9)
    assert lat == pytest.approx(LAT, rel=1e-6)


def test_calibration_recovers_the_machine() -> None:
    cal = simcal.calibrate(SPEC, reference_chunks(), opt_s=0.01, pingpong=PING)
    assert cal.reference == "single"
    assert cal.device_flops == pytest.approx(RATE, rel=1e-12)
    params = SPEC.num_layers * SPEC.params_per_layer() + SPEC.embedding_params()
    assert cal.device_mem_bw_Bps == pytest.approx(params * simcal.ADAMW_BYTES_PER_PARAM / 0.01)
    assert cal.link_bw_Bps == pytest.approx(BW) and cal.link_latency_s == pytest.approx(LAT)


def test_prediction_of_the_reference_reproduces_its_measurement() -> None:
    opt_s = 0.012
    chunks = reference_chunks()
    cal = simcal.calibrate(SPEC, chunks, opt_s, PING)
    measured = sum(d for _, _, d in chunks) / 3 + opt_s  # one iteration: 8 × (F + B) + optimizer
    assert simcal.predict("single", cal, DOCS) == pytest.approx(measured, rel=1e-9)
    rows, ref = simcal.compare({"single": measured, "pp2": 0.2}, cal, DOCS)
    assert ref.layout == "single" and ref.error == pytest.approx(0.0, abs=1e-9)
    assert [r.layout for r in rows] == ["pp2"]  # the reference is not scored


def test_predictions_use_the_simulators_perf_model() -> None:
    cal = simcal.calibrate(SPEC, reference_chunks(), 0.01, PING)
    single = simcal.predict("single", cal, DOCS)
    # DP2: half the micro-batches per replica, plus a gradient ring: between half and all of single
    dp2 = simcal.predict("dp2", cal, DOCS)
    terms = simcal.model_terms("dp2", cal, DOCS)
    assert terms["dp_s"] > 0 and terms["total_s"] == pytest.approx(dp2)
    assert single / 2 < dp2 < single
    # the same number the cluster simulation's PerfModel computes for that job
    job = simcal.job_for("tp2", cal, DOCS)
    assert isinstance(job, JobSpec)
    assert simcal.predict("tp2", cal, DOCS) == PerfModel(job).iteration_s(job.initial_plan(), World(2, 2))


def test_tp_ring_pays_one_latency_per_step() -> None:
    """Each of the 4 all-reduces per layer is a ring of 2(tp-1) steps: the TP2 iteration
    grows by exactly that many latencies when the link latency grows."""
    cal = simcal.calibrate(SPEC, reference_chunks(), 0.01, PING)
    slow = simcal.Calibration(cal.reference, cal.device_flops, cal.device_mem_bw_Bps, cal.link_bw_Bps,
                           cal.link_latency_s + 1e-3)
    delta = simcal.predict("tp2", slow, DOCS) - simcal.predict("tp2", cal, DOCS)
    # 8 micro-batches × (F + B) × 2 all-reduces per layer × 2 ring steps
    assert delta == pytest.approx(8 * 2 * 2 * SPEC.num_layers * 2 * 1e-3, rel=1e-9)


def test_mape_over_predicted_layouts() -> None:
    rows = [simcal.Row("tp2", 1.0, 1.1), simcal.Row("pp2", 0.5, 0.45), simcal.Row("dp2", 0.4, 0.4)]
    assert simcal.mape(rows) == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert rows[1].error == pytest.approx(-0.1)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_measured_times_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="measured iteration time of pp2 must be a finite number > 0"):
        simcal.mape([simcal.Row("pp2", bad, 0.3)])
    cal = simcal.calibrate(SPEC, reference_chunks(), 0.01, PING)
    with pytest.raises(ValueError, match="measured iteration time of tp2"):
        simcal.compare({"single": 0.3, "tp2": bad}, cal, DOCS)
    chunks = reference_chunks()
    chunks[3] = ("B", DOCS, bad)
    with pytest.raises(ValueError, match="reference B chunk time must be a finite number > 0"):
        simcal.calibrate(SPEC, chunks, 0.01, PING)
    with pytest.raises(ValueError, match="reference optimizer time"):
        simcal.calibrate(SPEC, reference_chunks(), bad, PING)


def test_other_bad_inputs_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="no predicted layouts"):
        simcal.mape([])
    with pytest.raises(ValueError, match="no F/B chunks"):
        simcal.calibrate(SPEC, [], 0.01, PING)
    with pytest.raises(ValueError, match="kind must be 'F' or 'B'"):
        simcal.calibrate(SPEC, [("W", DOCS, 0.01)], 0.01, PING)
    with pytest.raises(ValueError, match="at least two message sizes"):
        simcal.fit_link([(4096.0, 1e-4), (4096.0, 2e-4)])
    with pytest.raises(ValueError, match="do not grow with the message size"):
        simcal.fit_link([(4096.0, 2e-4), (65536.0, 1e-4)])
    cal = simcal.calibrate(SPEC, reference_chunks(), 0.01, PING)
    with pytest.raises(ValueError, match="reference layout 'single' has no measurement"):
        simcal.compare({"pp2": 0.2}, cal, DOCS)
    with pytest.raises(ValueError, match="unknown layout 'tp4'"):
        simcal.predict("tp4", cal, DOCS)
    with pytest.raises(ValueError, match="no measured micro-batches"):
        simcal.typical_seqlens([])


def test_typical_seqlens_is_the_median_attention_work() -> None:
    mbs = [(128,), (64, 64), (32,) * 4, (100, 28), (16,) * 8]
    assert simcal.typical_seqlens(mbs) == (64, 64)


def test_jobspec_refuses_bad_optimizer_and_activation_widths() -> None:
    with pytest.raises(SpecError, match="activation_bytes_per_value must be > 0"):
        JobSpec(SPEC, 1, 1, 1, 8, gpus_per_node=1, activation_bytes_per_value=0.0)
    with pytest.raises(SpecError, match="device_mem_bw_Bps must be > 0"):
        JobSpec(SPEC, 1, 1, 1, 8, gpus_per_node=1, device_mem_bw_Bps=0.0)


def _records(rank: int, step_s: list[float], f_s: float, b_s: float) -> dict[str, object]:
    steps = [{"time_s": t, "cpu_s": t / 2, "proc_cpu_s": t / 2, "seqlens": [list(DOCS)] * 4,
              "chunks": [(k, mb, d) for mb in range(4) for k, d in (("F", f_s), ("B", b_s))] + [("OPT", -1, 0.01)]}
             for t in step_s]
    return {"rank": rank, "steps": steps}


def test_reduce_run_takes_the_slowest_rank_and_the_median() -> None:
    per_rank = [_records(0, [0.20, 0.22, 0.90], 0.01, 0.02), _records(1, [0.21, 0.25, 0.30], 0.01, 0.02)]
    m = svr.reduce_run("dp2", per_rank, SPEC)
    assert m.iteration_s == pytest.approx(0.25)  # median of the per-step maxima (0.21, 0.25, 0.90)
    assert m.spread[0] == pytest.approx(0.21) and m.spread[1] == pytest.approx(0.90)
    assert m.parts["F"] == pytest.approx(0.04) and m.parts["OPT"] == pytest.approx(0.01)
    assert m.cpu_share == pytest.approx(0.5)
    f, b = simcal.microbatch_flops(SPEC, DOCS, SPEC.num_layers, 1, True, True)
    assert m.achieved_flops == pytest.approx((f + b) / 0.03)
    chunks, opt = svr.reference_inputs(per_rank)  # DP replicas hold the whole model: a valid reference
    assert len(chunks) == 2 * 3 * 8 and opt == pytest.approx(0.01)
    with pytest.raises(ValueError, match="ranks recorded \\[3, 2\\] steps"):
        svr.reduce_run("dp2", [per_rank[0], _records(1, [0.2, 0.2], 0.01, 0.02)], SPEC)


def test_missing_records_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the real runs' records in"):
        svr.load_runs(str(tmp_path))


def test_the_runtime_time_per_op_is_what_the_steps_spend_outside_their_chunks() -> None:
    # 4 micro-batches: 8 F/B ops of 0.01 + 0.02 s and a 0.01 s optimizer step: 0.13 s of chunks
    per_rank = [_records(0, [0.17, 0.21, 0.15], 0.01, 0.02)]
    assert svr.op_overhead(per_rank) == pytest.approx(0.04 / 8)  # the median step, 0.17 s
    cal = simcal.calibrate(SPEC, reference_chunks(), 0.01, PING, op_overhead_s=0.005)
    assert cal.op_overhead_s == 0.005
    with pytest.raises(ValueError, match="op_overhead_s must be a finite number >= 0"):
        simcal.calibrate(SPEC, reference_chunks(), 0.01, PING, op_overhead_s=-1.0)


def test_the_perf_model_adds_the_runtime_time_to_every_forward_and_backward() -> None:
    job = JobSpec(SPEC, 1, 2, 1, 8, gpus_per_node=2, device_flops=1e10)
    with_gap = replace(job, op_overhead_s=0.001)
    world = World(2, 2)
    base = PerfModel(job).iteration_s(job.initial_plan(), world)
    slower = PerfModel(with_gap).iteration_s(with_gap.initial_plan(), world)
    # 1F1B over 2 stages and 8 micro-batches: (m + p - 1) forward and backward slots on the critical path
    assert slower - base == pytest.approx((8 + 2 - 1) * 2 * 0.001, rel=1e-6)
    with pytest.raises(SpecError, match="op_overhead_s must be a finite number >= 0"):
        replace(job, op_overhead_s=float("nan"))
