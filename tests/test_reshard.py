"""Reshard planner: exhaustive over small layouts, checked against an independent oracle.

Every TP 1/2/4 × PP 1/2/4 × DP 1/2 layout of ≤ 8 ranks is resharded to every other, with
and without dead ranks; each result is executed on numpy arrays and must rebuild exactly
the slices of the full tensors the new plan assigns.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from resihp.coordinator.model.plan import PipelinePlan, Plan, Schedule
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.reconfig.reshard import STATES, ReshardError, Transfer, plan_reshard
from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs, shard_slice, tensors_of_rank

MODEL = ModelSpec("t", num_layers=4, hidden=8, num_heads=4, ffn_hidden=16, vocab=12)
ALL_SPECS = gpt_tensor_specs(MODEL, max_seq_len=6)
# the exhaustive sweep keeps one tensor of each kind per layer (unsplit, split on dim 0 / 1, 1-D)
_KINDS = ("ln1.weight", "attn.qkv.weight", "attn.proj.weight", "mlp.fc1.bias")
SPECS = [s for s in ALL_SPECS if s.layer is None or s.name.split(".", 2)[2] in _KINDS]
BY_NAME = {s.name: s for s in ALL_SPECS}
SHAPES = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2, 4) for dp in (1, 2) if tp * pp * dp <= 8]
UNIVERSE = list(range(12))  # old plans use 0..w-1; new plans the first alive ranks of this pool
NODE_OF = {r: f"n{r // 2}" for r in UNIVERSE}


def uniform(shape: tuple[int, int, int], ranks: list[int]) -> Plan:
    tp, pp, dp = shape
    return Plan.uniform(tp, pp, dp, MODEL.num_layers, 4, ranks=ranks[: tp * pp * dp])


def axis(name: str) -> int:
    d = BY_NAME[name].tp_dim
    return 0 if d is None else d


def interval(index: tuple[slice, ...], name: str) -> tuple[int, int]:
    s = index[axis(name)]
    return s.start, s.stop


def holdings(plan: Plan, alive: set[int]) -> dict[str, dict[int, tuple[int, int]]]:
    out: dict[str, dict[int, tuple[int, int]]] = {s.name: {} for s in SPECS}
    for r in plan.ranks():
        if r in alive:
            for spec, idx in tensors_of_rank(plan, r, SPECS):
                out[spec.name][r] = interval(idx, spec.name)
    return out


def recoverable(old: Plan, alive: set[int]) -> bool:
    """Oracle: every element of every tensor is held by some alive old rank."""
    held = holdings(old, alive)
    for spec in SPECS:
        n = spec.shape[axis(spec.name)]
        cover = np.zeros(n, dtype=bool)
        for lo, hi in held[spec.name].values():
            cover[lo:hi] = True
        if not cover.all():
            return False
    return True


def execute(old: Plan, new: Plan, transfers: tuple[Transfer, ...], full: dict[str, np.ndarray], alive: set[int]) -> None:
    """Run the transfers on numpy arrays; each new shard must be the full tensor's slice."""
    old_shards = {(r, s.name): full[s.name][idx] for r in old.ranks() if r in alive for s, idx in tensors_of_rank(old, r, SPECS)}
    new_shards = {
        (r, s.name, state): np.full(full[s.name][idx].shape, np.nan)
        for r in new.ranks() for s, idx in tensors_of_rank(new, r, SPECS) for state in STATES
    }
    hits = {k: np.zeros(v.shape, dtype=np.int64) for k, v in new_shards.items()}
    for t in transfers:
        assert t.src in alive and t.dst in alive
        piece = old_shards[(t.src, t.name)][t.src_index]
        assert piece.shape == t.shape and t.nbytes == piece.size * 4
        assert np.array_equal(piece, full[t.name][t.index]), t
        new_shards[(t.dst, t.name, t.state)][t.dst_index] = piece
        hits[(t.dst, t.name, t.state)][t.dst_index] += 1
    for key, arr in new_shards.items():
        assert (hits[key] == 1).all(), f"{key}: covered {hits[key].min()}..{hits[key].max()} times"
        r, name, _ = key
        pos = new.position(r)
        assert np.array_equal(arr, full[name][shard_slice(BY_NAME[name], pos.tp_index, pos.tp_size)]), key


def check(old: Plan, new: Plan, alive: set[int], full: dict[str, np.ndarray]) -> None:
    if not recoverable(old, alive):
        with pytest.raises(ReshardError, match="checkpoint"):
            plan_reshard(old, new, SPECS, alive, NODE_OF)
        return
    plan = plan_reshard(old, new, SPECS, alive, NODE_OF)
    execute(old, new, plan.transfers, full, alive)
    old_held = holdings(old, alive)
    # minimal: bytes moved are exactly the bytes a destination did not already hold
    expected_moved = 0
    for r in new.ranks():
        for spec, idx in tensors_of_rank(new, r, SPECS):
            lo, hi = interval(idx, spec.name)
            own = old_held[spec.name].get(r)
            overlap = max(0, min(hi, own[1]) - max(lo, own[0])) if own else 0
            row = spec.numel // spec.shape[axis(spec.name)] * 4
            expected_moved += (hi - lo - overlap) * row * len(STATES)
    assert plan.bytes_moved == expected_moved
    assert plan.bytes_needed == sum(
        spec.numel // spec.shape[axis(spec.name)] * (interval(idx, spec.name)[1] - interval(idx, spec.name)[0]) * 4 * 3
        for r in new.ranks() for spec, idx in tensors_of_rank(new, r, SPECS)
    )
    # same-node preference: a remote source off the node only if no node-mate holds any of the piece
    for t in plan.transfers:
        if t.is_local or NODE_OF[t.src] == NODE_OF[t.dst]:
            continue
        lo, hi = interval(t.index, t.name)
        for r, (c0, c1) in old_held[t.name].items():
            if r != t.dst and NODE_OF[r] == NODE_OF[t.dst]:
                assert c1 <= lo or hi <= c0, f"{t}: node-mate {r} holds [{c0},{c1})"
    assert sum(plan.send_bytes.values()) == sum(plan.recv_bytes.values()) == plan.bytes_moved
    # one order on every rank (the executor pairs sends and receives by it): sender, receiver,
    # tensor, state, then the whole global index
    keys = [(t.src, t.dst, t.name, t.state, [(s.start, s.stop) for s in t.index]) for t in plan.transfers]
    assert keys == sorted(keys)


def dead_sets(old: Plan) -> list[set[int]]:
    ranks = list(old.ranks())
    sets: list[set[int]] = [set(), {ranks[0]}, {ranks[-1]}]
    if old.dp == 2:
        r0 = old.replicas[0].stages[0][0]
        r1 = old.replicas[1].stages[-1][-1]
        sets.append({r0, r1})  # one in each replica, different pieces (unless pp == tp == 1)
        sets.append(set(old.replicas[0].ranks()))  # a whole replica
    return sets


@pytest.fixture(scope="module")
def full() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {s.name: rng.standard_normal(s.shape) for s in ALL_SPECS}


@pytest.mark.parametrize("old_shape", SHAPES, ids=lambda s: "tp{}pp{}dp{}".format(*s))
def test_exhaustive_old_to_new(old_shape: tuple[int, int, int], full: dict[str, np.ndarray]) -> None:
    old = uniform(old_shape, UNIVERSE)
    for new_shape in SHAPES:
        for dead in dead_sets(old):
            alive = set(UNIVERSE) - dead
            pool = [r for r in UNIVERSE if r in alive]
            # same ranks in order; with no deaths also a rotated order so roles move between ranks
            for ranks in ([pool, pool[3:] + pool[:3]] if not dead else [pool]):
                check(old, uniform(new_shape, ranks), alive, full)


def test_identical_plan_moves_nothing() -> None:
    plan = Plan.uniform(2, 2, 2, 4, 4)
    result = plan_reshard(plan, plan, ALL_SPECS, range(8))
    assert result.bytes_moved == 0 and all(t.is_local for t in result.transfers)
    held = sum(int(np.prod([x.stop - x.start for x in idx])) for r in range(8) for _, idx in tensors_of_rank(plan, r, ALL_SPECS))
    assert result.bytes_local == held * 3 * 4  # 3 states, fp32


def test_tp4_to_tp2_keeps_overlap_local() -> None:
    old = Plan.uniform(4, 1, 1, 4, 4)
    new = Plan.uniform(2, 1, 1, 4, 4, ranks=[0, 2])
    result = plan_reshard(old, new, ALL_SPECS, range(4), states=("param",))
    qkv = [t for t in result.transfers if t.name == "layers.0.attn.qkv.weight"]
    # new rank 0 holds rows [0,12): [0,6) local, [6,12) from old rank 1; rank 2 holds [12,24): [12,18) local
    got = sorted((t.src, t.dst, interval(t.index, t.name)) for t in qkv)
    assert got == [(0, 0, (0, 6)), (1, 0, (6, 12)), (2, 2, (12, 18)), (3, 2, (18, 24))]
    local = {t.dst: t.dst_index for t in qkv if t.is_local}
    assert local[2] == (slice(0, 6), slice(0, 8))  # rows [12,18) are the first rows of rank 2's new shard


def test_lost_shard_comes_from_surviving_replica_same_node_first() -> None:
    old = Plan.uniform(2, 1, 2, 4, 4)  # replica 0: ranks 0,1; replica 1: ranks 2,3
    new = Plan.uniform(2, 1, 1, 4, 4, ranks=[0, 4])  # rank 1 died; spare 4 takes its place
    nodes = {0: "a", 1: "a", 2: "b", 3: "c", 4: "c"}
    result = plan_reshard(old, new, ALL_SPECS, {0, 2, 3, 4}, nodes)
    to4 = {t.src for t in result.transfers if t.dst == 4}
    assert to4 == {3}  # rank 3 holds the same TP slice on rank 4's node
    assert all(t.is_local for t in result.transfers if t.dst == 0)


def test_load_spreads_over_replicas() -> None:
    old = Plan.uniform(1, 1, 2, 4, 4)  # ranks 0 and 1 each hold everything
    new = Plan.uniform(2, 2, 1, 4, 4, ranks=[2, 3, 4, 5])
    result = plan_reshard(old, new, ALL_SPECS, range(6))
    largest = max(t.nbytes for t in result.transfers)
    assert abs(result.send_bytes[0] - result.send_bytes[1]) <= largest
    assert result.max_send_bytes <= result.bytes_moved / 2 + largest


def test_no_replica_left_names_the_tensor() -> None:
    old = Plan.uniform(2, 2, 1, 4, 4)
    new = Plan.uniform(1, 2, 1, 4, 4, ranks=[0, 2])
    with pytest.raises(ReshardError) as info:
        plan_reshard(old, new, ALL_SPECS, {0, 2, 3})
    msg = str(info.value)
    assert "layers.0.attn.qkv.weight" in msg and "[12:24, 0:8]" in msg and "[1]" in msg and "checkpoint" in msg
    assert ("layers.0.attn.qkv.weight", "param", (slice(12, 24), slice(0, 8))) in info.value.missing


def test_bad_input_is_explained() -> None:
    old = Plan.uniform(2, 1, 1, 4, 4)
    with pytest.raises(SpecError, match="not alive"):
        plan_reshard(old, Plan.uniform(2, 1, 1, 4, 4, ranks=[0, 5]), ALL_SPECS, {0, 1})
    with pytest.raises(SpecError, match="runs 3 layers"):
        plan_reshard(old, Plan(replicas=(PipelinePlan(((0,),), (3,), 1),)), ALL_SPECS, {0, 1})
    with pytest.raises(SpecError, match="states"):
        plan_reshard(old, old, ALL_SPECS, {0, 1}, states=("momentum",))
    with pytest.raises(SpecError, match="does not split evenly"):
        plan_reshard(old, Plan.uniform(8, 1, 1, 4, 4), ALL_SPECS, range(8))


def test_interleaved_and_uneven_pipelines() -> None:
    model = ModelSpec("t8", num_layers=8, hidden=8, num_heads=4, ffn_hidden=16, vocab=12)
    specs = gpt_tensor_specs(model, 6)
    old = Plan.uniform(2, 2, 1, 8, 4, schedule=Schedule.INTERLEAVED, virtual_chunks=2)
    # stage 0 runs layers 0-1 and 4-5, stage 1 runs 2-3 and 6-7 and holds the last tensors
    assert {s.layer for s, _ in tensors_of_rank(old, 0, specs)} == {0, 1, 4, 5, None}
    assert any(s.name == "lm_head.weight" for s, _ in tensors_of_rank(old, 2, specs))
    new = Plan(replicas=(PipelinePlan(((0, 1), (2, 3)), (5, 3), 4),))  # (4,4) -> (5,3)
    result = plan_reshard(old, new, specs, range(4), states=("param",))
    moved = {(t.src, t.dst, t.name.split(".")[1]) for t in result.transfers if not t.is_local and t.name.startswith("layers")}
    assert {n for _, _, n in moved} == {"2", "3", "5"}  # 2 and 3 go stage 1 -> 0; 5 goes 0 -> 1


def test_gqa_and_gated_models_are_rejected() -> None:
    with pytest.raises(SpecError, match="reference GPT"):
        gpt_tensor_specs(ModelSpec("g", 2, 8, 4, 16, 12, num_kv_heads=2), 4)
    assert len(gpt_tensor_specs(MODEL, 6)) == 2 + 12 * 4 + 3
    assert list(itertools.islice((s.name for s in ALL_SPECS), 3)) == ["embed.weight", "pos_embed.weight", "layers.0.ln1.weight"]
