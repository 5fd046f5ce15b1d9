"""The runtime's pieces in one process: data packing, masks, schedule, groups, throttle, hooks."""
from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.env_settings import parse_throttle_env
from resihp.trainer_hooks.hooks import Job
from resihp.trainer_hooks.reporting.reporter import MemoryTransport
from resihp.trainer_hooks.runtime.data import GlobalBatches, PackedStream, split_documents
from resihp.trainer_hooks.runtime.groups import (
    mixed_tp_names,
    mixed_tp_sizes,
    param_names,
    pipeline_peers,
    place_of,
    rank_sets,
    shard_holders,
)
from resihp.trainer_hooks.runtime.layout import TensorSpec
from resihp.trainer_hooks.runtime.model import Block, GPTStage, PackedMeta, init_full_tensor, loss_sum
from resihp.trainer_hooks.runtime.pipeline import schedule_1f1b
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.trainer import TrainConfig, mixed_slices

SPEC = ModelSpec("unit", num_layers=4, hidden=32, num_heads=4, ffn_hidden=64, vocab=256)


@pytest.fixture(scope="module")
def stream() -> PackedStream:
    return PackedStream(48, seed=3)


def test_packing_fills_every_microbatch_with_whole_or_continued_documents(stream: PackedStream) -> None:
    for i in range(20):
        mb = stream.get(i)
        assert mb.sample_id == i
        assert sum(mb.seqlens) == mb.num_tokens == 48
        assert all(n >= 1 for n in mb.seqlens)
        assert torch.equal(mb.tokens[1:], mb.targets[:-1]) or len(mb.seqlens) > 1
        assert int(mb.tokens.max()) < 256
    assert any(len(stream.get(i).seqlens) > 1 for i in range(20)), "packing should mix documents"


def test_stream_is_a_pure_function_of_the_seed(stream: PackedStream) -> None:
    again = PackedStream(48, seed=3)
    other = PackedStream(48, seed=4)
    assert torch.equal(again.get(7).tokens, stream.get(7).tokens)
    assert not torch.equal(other.get(0).tokens, stream.get(0).tokens)


def test_split_documents_drops_blank_blocks() -> None:
    assert split_documents(b"a = 1\n\n\n\ndef f():\n    pass\n\n \n") == [b"a = 1", b"def f():\n    pass"]


def test_replica_shares_partition_the_global_batch_in_order(stream: PackedStream) -> None:
    batches = GlobalBatches(stream, 8)
    reps = tuple(PipelinePlan(((r,),), (4,), s) for r, s in enumerate([3, 0, 4, 1]))
    plan = Plan(replicas=reps)
    ids = [i for r in range(4) for i in batches.for_replica(2, plan, r).sample_ids]
    assert ids == list(range(16, 24))
    assert batches.for_replica(2, plan, 1).microbatches == ()
    assert batches.for_replica(2, plan, 0).global_tokens == 8 * 48
    with pytest.raises(SpecError, match="shares sum to 4"):
        batches.for_replica(0, Plan.uniform(1, 1, 2, 4, 4), 0)


def test_packed_meta_masks_across_documents_and_restarts_positions() -> None:
    meta = PackedMeta.from_seqlens([2, 3])
    assert meta.positions.tolist() == [0, 1, 0, 1, 2]
    assert meta.mask[3].tolist() == [False, False, True, True, False]
    assert meta.mask[1].tolist() == [True, True, False, False, False]


def test_a_packed_document_sees_nothing_of_its_neighbours() -> None:
    torch.manual_seed(0)
    model = GPTStage(SPEC, 16, (0, 4), True, True)
    model.init_from_seed(1)
    a, b = torch.randint(0, 256, (5,)), torch.randint(0, 256, (7,))
    packed = model(torch.cat([a, b]), PackedMeta.from_seqlens([5, 7]))
    alone = model(b, PackedMeta.from_seqlens([7]))
    torch.testing.assert_close(packed[5:], alone, rtol=1e-5, atol=1e-5)


def test_parameter_names_and_shapes_follow_the_layout_contract() -> None:
    model = GPTStage(SPEC, 16, (0, 4), True, True)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs

    assert names == {s.name: tuple(s.shape) for s in gpt_tensor_specs(SPEC, 16)}


def test_initial_weights_do_not_depend_on_the_layout() -> None:
    full = init_full_tensor(SPEC, 16, "layers.2.attn.qkv.weight", seed=5)
    assert torch.equal(full, init_full_tensor(SPEC, 16, "layers.2.attn.qkv.weight", seed=5))
    assert not torch.equal(full, init_full_tensor(SPEC, 16, "layers.3.attn.qkv.weight", seed=5))
    model = GPTStage(SPEC, 16, (2, 3), False, True)
    model.init_from_seed(5)
    block = model.layers["2"]
    assert isinstance(block, Block)
    assert torch.equal(block.attn.qkv.weight.detach(), full)
    assert float(loss_sum(torch.zeros(3, 256), torch.tensor([0, 1, 2]))) == pytest.approx(3 * torch.log(torch.tensor(256.0)).item())


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 8), (4, 2)])
def test_1f1b_runs_every_microbatch_forward_before_backward(pp: int, m: int) -> None:
    for stage in range(pp):
        order = schedule_1f1b(pp, stage, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
        in_flight = max(sum(1 for k, i in order[: j + 1] if k == "F") - sum(1 for k, i in order[: j + 1] if k == "B")
                        for j in range(len(order)))
        assert in_flight == min(pp - stage, m)  # 1F1B's memory bound


def test_pipeline_peers_pair_stages_of_different_tp_sizes() -> None:
    plan = Plan(replicas=(PipelinePlan(((0, 1), (2,), (3, 4, 5, 6)), (1, 2, 1), 2),))
    a, b, c = place_of(plan, 1), place_of(plan, 2), place_of(plan, 5)
    assert a.send_fwd_to == () and a.recv_bwd_from == 2  # TP rank 0 alone feeds the narrower stage
    assert place_of(plan, 0).send_fwd_to == (2,)
    assert b.recv_fwd_from == 0 and b.send_bwd_to == (0, 1) and b.send_fwd_to == (3, 4, 5, 6)
    assert c.recv_fwd_from == 2 and c.send_bwd_to == () and c.last


def test_every_pipeline_neighbour_pair_gets_a_group_of_its_own() -> None:
    plan = Plan(replicas=(PipelinePlan(((0, 1), (2,), (3, 4, 5, 6)), (1, 2, 1), 2),))
    assert pipeline_peers(place_of(plan, 1)) == (2,)  # it only receives gradients from rank 2
    assert pipeline_peers(place_of(plan, 2)) == (0, 1, 3, 4, 5, 6)
    pairs = {s for s in rank_sets(plan) if len(s) == 2}
    assert {(0, 2), (1, 2), (2, 3), (2, 4), (2, 5), (2, 6)} <= pairs
    assert (0, 1) in pairs  # the first stage's TP group, which also has two ranks
    assert not any(set(p) <= {3, 4, 5, 6} for p in pairs)  # no pipeline pair inside a stage


def test_dp_buckets_follow_the_shard_holders_even_with_uneven_layer_splits() -> None:
    plan = Plan(replicas=(
        PipelinePlan(((0,), (1,)), (1, 3), 2),
        PipelinePlan(((2,), (3,)), (2, 2), 2),
    ))
    holders = shard_holders(plan)
    assert holders[("layers.1.mlp.fc1.weight", 0, 1)] == (1, 2)
    assert holders[("embed.weight", 0, 1)] == (0, 2)
    assert holders[("lm_head.weight", 0, 1)] == (1, 3)
    assert "layers.3.ln1.weight" in param_names(place_of(plan, 3))


def test_a_layer_split_over_different_tp_sizes_is_summed_over_all_its_holders() -> None:
    # replica 0 runs layers 0-1 on TP2 (ranks 0, 1) and 2-3 on TP1 (rank 2); replica 1 all
    # on TP1 (ranks 3, 4): layers 0-1 are mixed, layers 2-3 are not
    plan = Plan(replicas=(PipelinePlan(((0, 1), (2,)), (2, 2), 1), PipelinePlan(((3,), (4,)), (2, 2), 1)))
    mixed = mixed_tp_names(plan)
    assert "layers.0.attn.qkv.weight" in mixed and "embed.weight" in mixed
    assert not any(n.startswith(("layers.2.", "layers.3.", "lm_head", "final_norm")) for n in mixed), sorted(mixed)
    holders = shard_holders(plan)
    # every holder of a mixed parameter sums it, under each of its keys
    assert holders[("layers.0.attn.qkv.weight", 1, 2)] == holders[("layers.0.attn.qkv.weight", 0, 1)] == (0, 1, 3)
    assert holders[("layers.2.attn.qkv.weight", 0, 1)] == (2, 4)
    uniform = Plan.uniform(2, 2, 2, 4, 4)
    assert mixed_tp_names(uniform) == frozenset()


def test_tp4_beside_tp2_sums_each_half_over_the_ranks_that_hold_parts_of_it() -> None:
    plan = Plan(replicas=(PipelinePlan(((0, 1, 2, 3),), (4,), 1), PipelinePlan(((4, 5),), (4,), 1)))
    sizes = mixed_tp_sizes(plan)
    assert sizes["layers.0.attn.qkv.weight"] == 2  # gcd(4, 2): halves
    holders = shard_holders(plan)
    for index, size, want in ((0, 4, (0, 1, 4)), (1, 4, (0, 1, 4)), (0, 2, (0, 1, 4)), (2, 4, (2, 3, 5)),
                              (3, 4, (2, 3, 5)), (1, 2, (2, 3, 5))):
        assert holders[("layers.0.attn.qkv.weight", index, size)] == want, (index, size)
    # TP rank 1 of the TP4 group: its quarter is the second half of the first half; a
    # TP-replicated weight is added by the first rank of each half only
    split = TensorSpec("w", (8, 4), 0, "layer", 0)
    whole = TensorSpec("b", (4,), 0, "layer", None)
    got = mixed_slices({"w": 2, "b": 2}, place_of(plan, 1), [split, whole])
    assert got["w"] == ((4, 4), (slice(2, 4), slice(0, 4)), True)
    assert got["b"] == ((4,), (slice(0, 4),), False)
    assert mixed_slices({"w": 2, "b": 2}, place_of(plan, 2), [split, whole])["b"][2] is True
    assert mixed_slices({"w": 2, "b": 2}, place_of(plan, 5), [split, whole])["w"] == (
        (4, 4), (slice(0, 4), slice(0, 4)), True)


def test_throttle_stalls_factor_minus_one_times_the_chunk() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.25
        return now[0]

    t = Throttle(3.0, mode="spin", clock=clock)
    assert t.stall_for(1.0) == pytest.approx(2.0)
    assert now[0] >= 2.0
    t.set_factor(1.0)
    assert t.stall_for(5.0) == 0.0
    with pytest.raises(ValueError, match=">= 1"):
        t.set_factor(0.5)


def test_the_compute_clock_follows_the_device_and_a_throttled_op_counts_its_stall() -> None:
    """"auto" times a CPU rank's ops in its thread's CPU time (ranks sharing cores see the
    scheduler in wall time only), a GPU's by CUDA events; "wall" is the default. A throttled
    CPU-clock op lasts factor x its CPU time, in wall time and in the recorded span, while the
    stall sleeps: the core is left to co-located ranks, as a slow GPU leaves its host idle."""
    from resihp.trainer_hooks.runtime.pipeline import ChunkLog, PipelineStep

    cpu = PipelineStep(None, None, torch.device("cpu"), Throttle(3.0), {}, "auto")  # type: ignore[arg-type]
    gpu = PipelineStep(None, None, torch.device("cuda", 0), Throttle(3.0), {}, "auto")  # type: ignore[arg-type]
    assert (cpu.compute_clock, gpu.compute_clock) == ("cpu", "wall")
    assert TrainConfig().compute_clock == "wall"
    with pytest.raises(SpecError, match="compute_clock must be 'auto', 'wall' or 'cpu'"):
        TrainConfig(compute_clock="gpu")

    def work() -> float:
        t = time.thread_time()
        while time.thread_time() - t < 0.02:
            pass
        return 1.0

    log = ChunkLog()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    cpu._compute(work, "F", 0, log)
    burnt, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    ((kind, mb, _chunk, start, end),) = log.chunks
    assert (kind, mb) == ("F", 0)
    assert end - start >= 3 * 0.02  # the op's CPU time and the stall of a 3x slower device
    assert wall >= end - start - 1e-3 and burnt < 2 * 0.02  # it waited the stall out, sleeping


def test_throttle_env_parsing() -> None:
    assert parse_throttle_env("1:2.0,3:1.5@10", 3) == (1.5, 10, None)
    assert parse_throttle_env("1:2.0,3:1.5@10-14", 3) == (1.5, 10, 14)
    assert parse_throttle_env("1:2.0", 1) == (2.0, 0, None)
    assert parse_throttle_env("1:2.0", 0) is None
    for bad in ("x", "3:2.0@10-10", "3:2.0@10-4", "3:2.0@10-"):
        with pytest.raises(SpecError, match="RANK:FACTOR"):
            parse_throttle_env(bad, 0)


def _job(transport: MemoryTransport, rank: int = 1) -> Job:
    boot: Any = types.SimpleNamespace(rank=rank, world_size=2, job_start_s=0.0, close=lambda: None)
    plan = Plan.uniform(1, 1, 2, 4, 2)
    return Job(boot=boot, model=SPEC, plan=plan, config=TrainConfig(), transport=transport, throttle=Throttle())


def test_step_reports_and_applies_a_throttle_at_its_iteration() -> None:
    tx = MemoryTransport()
    job = _job(tx)
    tx.push(m.ThrottleCommand(epoch=0, factor=2.0, apply_at=3, seq=1, ranks=(1,)))
    tx.push(m.ThrottleCommand(epoch=0, factor=4.0, apply_at=1, seq=2, ranks=(0,)))  # someone else's
    out = job.step(iteration=0, seqlens=[[3, 5]], time_s=0.01)
    assert out.applied == () and job.throttle.factor == 1.0
    out = job.step(iteration=2, seqlens=[[8]], time_s=0.01)
    assert out.applied == ("throttle",) and job.throttle.factor == 2.0
    assert tx.acks == [(1, 3, True, "")]
    assert [r.iteration for r in tx.reports] == [0, 2]
    assert tx.reports[0].seqlens == ((3, 5),)


def test_step_refuses_a_reconfiguration_it_cannot_apply_and_drains_on_request() -> None:
    tx = MemoryTransport()
    job = _job(tx)
    tx.push(m.ReconfigCommand(epoch=1, plan=Plan.uniform(1, 1, 2, 4, 2), apply_at=1, seq=5))
    tx.push(m.DrainCommand(epoch=0, apply_at=1, seq=6))
    out = job.step(iteration=0, time_s=0.01)
    assert out.stop and out.applied == ("drain",)
    seq, it, ok, error = tx.acks[0]
    assert (seq, it, ok) == (5, 1, False) and "staying on plan epoch 0" in error


def test_presets_used_by_the_examples_fit_the_runtime() -> None:
    spec = preset("gpt-tiny")
    GPTStage(spec, 32, (0, spec.num_layers), True, True)
    with pytest.raises(SpecError, match="GELU"):
        GPTStage(preset("llama2-7b"), 32, (0, 1), True, True)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_an_op_records_its_time_inside_tp_collectives_as_a_tp_chunk(world1: None, clock: str) -> None:
    # a real gloo all-reduce (a world of one) inside an F op: on the wall clock the op's
    # span holds it, and a TP chunk of that time ends where the op ends; CPU-time spans
    # leave waits out already, so they get none
    from resihp.trainer_hooks.runtime import tp_layers
    from resihp.trainer_hooks.runtime.pipeline import ChunkLog, PipelineStep

    step = PipelineStep(None, None, torch.device("cpu"), Throttle(), {}, compute_clock=clock)  # type: ignore[arg-type]
    log = ChunkLog()
    before = tp_layers.collective_seconds()

    def forward() -> torch.Tensor:
        x = torch.ones(1024)
        for _ in range(5):
            tp_layers._timed_all_reduce(x, None)
        return x

    out = step._compute(forward, "F", 3, log)
    waited = tp_layers.collective_seconds() - before
    assert out.tolist() == [1.0] * 1024 and waited > 0.0
    kinds = [c[0] for c in log.chunks]
    if clock == "cpu":
        assert kinds == ["F"]
        return
    assert kinds == ["F", "TP"]
    (_, _, _, fs, fe), (_, mb, chunk, ts, te) = log.chunks
    assert (mb, chunk) == (3, 0) and te == fe and fs <= ts
    assert te - ts == pytest.approx(waited, rel=1e-6)


def test_compute_probe_takes_its_throttle_and_the_best_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # the probe's clock (thread CPU time on a CPU) read through a fake that advances 10 ms per
    # round, then 5 ms, then 8 ms: the probe is the best round, stretched by the throttle as
    # a compute chunk is (a 2x sleep throttle: + its duration)
    from resihp.trainer_hooks.runtime import probe as probe_mod

    rounds = iter([0.0, 0.010, 1.0, 1.005, 2.0, 2.008])
    monkeypatch.setattr(probe_mod.time, "thread_time", lambda: next(rounds))
    threads = torch.get_num_threads()
    p = probe_mod.ComputeProbe(torch.device("cpu"), Throttle(2.0))
    p._warm = True  # no untimed warm-up round in this test
    assert p.run() == pytest.approx(0.010)  # best round 5 ms, x2
    assert torch.get_num_threads() == threads  # one torch thread only while probing
    with pytest.raises(ValueError, match="probe rounds must be >= 1, got 0"):
        probe_mod.ComputeProbe(torch.device("cpu"), Throttle(), rounds=0)


def test_probe_interval_comes_from_init_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from resihp.trainer_hooks.env_settings import PROBE_ENV, probe_interval

    monkeypatch.delenv(PROBE_ENV, raising=False)
    assert probe_interval(None) == 30.0 and probe_interval(5.0) == 5.0
    monkeypatch.setenv(PROBE_ENV, "2.5")
    assert probe_interval(None) == 2.5 and probe_interval(7.0) == 7.0
    monkeypatch.setenv(PROBE_ENV, "soon")
    with pytest.raises(SpecError, match="RESIHP_PROBE_EVERY_S='soon': expected seconds between an idle rank's probes"):
        probe_interval(None)
    with pytest.raises(SpecError, match="probe_every_s must be a finite number of seconds > 0, got 0.0"):
        probe_interval(0.0)


def test_a_lengthened_timeout_goes_back_after_enough_short_steps_in_a_row() -> None:
    from resihp.trainer_hooks.reconfig.timeouts import RESTORE_AFTER_STEPS, TimeoutRestore

    watch = TimeoutRestore(base_s=6.0)
    assert not any(watch.after_step(0.1, 6.0) for _ in range(50))  # never lengthened: nothing to restore
    # lengthened to 12 s: a step of 3 s or more (half the original timeout) restarts the count
    assert not any(watch.after_step(0.1, 12.0) for _ in range(RESTORE_AFTER_STEPS - 1))
    assert watch.after_step(3.0, 12.0) is False
    assert not any(watch.after_step(2.9, 12.0) for _ in range(RESTORE_AFTER_STEPS - 1))
    assert watch.after_step(2.9, 12.0) is True  # the 8th short step in a row
    assert watch.after_step(0.1, 6.0) is False and watch.short_run == 0  # restored
    assert watch.after_step(float("nan"), 12.0) is False and watch.short_run == 0  # no number, no evidence
