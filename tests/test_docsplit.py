"""The data path of token-share plans: documents cut among replicas, re-packed, in one process."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.data import GlobalBatches, PackedStream
from resihp.trainer_hooks.runtime.docsplit import pack, split_runs
from resihp.trainer_hooks.runtime.model import IGNORE, GPTStage, PackedMeta, loss_sum

B = 64  # tokens per stream micro-batch
G = 8  # micro-batches per global batch


@pytest.fixture(scope="module")
def stream() -> PackedStream:
    return PackedStream(B, seed=5)


def token_plan(shares: list[tuple[int, int]]) -> Plan:
    """DP replicas of one stage each: (micro-batches, tokens) per replica."""
    return Plan(replicas=tuple(PipelinePlan(((r,),), (4,), m, t) for r, (m, t) in enumerate(shares)))


@pytest.mark.parametrize("seed", range(30))
def test_runs_cover_every_document_once_and_meet_the_shares_within_one_document(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 80) for _ in range(rng.randint(1, 60))]
    shares = [rng.choice([0, rng.randint(1, 1000)]) for _ in range(rng.randint(1, 6))]
    if not any(shares):
        shares[0] = 1
    runs = split_runs(lengths, shares)
    assert [i for run in runs for i in run] == list(range(len(lengths)))  # contiguous, in order, each once
    assert split_runs(lengths, shares) == runs  # a pure function of lengths and shares
    total, weight = sum(lengths), sum(shares)
    for run, share in zip(runs, shares):
        got = sum(lengths[i] for i in run)
        assert abs(got - total * share / weight) <= max(lengths), (got, share, lengths)
        if share == 0:
            assert not run


def test_equal_shares_of_equal_documents_split_evenly() -> None:
    assert split_runs([10] * 8, [3, 1]) == [range(0, 6), range(6, 8)]
    assert split_runs([10] * 8, [0, 5, 0, 5, 0]) == [range(0, 0), range(0, 4), range(4, 4), range(4, 8), range(8, 8)]
    with pytest.raises(ValueError, match="positive sum"):
        split_runs([1], [0, 0])


def test_pack_keeps_the_count_stays_under_the_cap_when_it_can_and_balances() -> None:
    assert pack([30, 30, 20, 20, 10, 10], 2, 60) == [[0, 2, 4], [1, 3, 5]]
    assert pack([5, 5, 5], 5, 64) == [[0], [1], [2]]  # fewer documents than micro-batches: none empty
    assert pack([], 3, 64) == []
    # 3 x 40 in 2 micro-batches of <= 64 cannot fit: the count holds, one exceeds by < one document
    got = pack([40, 40, 40], 2, 64)
    assert len(got) == 2 and sorted(i for g in got for i in g) == [0, 1, 2]
    assert max(sum(40 for _ in g) for g in got) == 80


@pytest.mark.parametrize("shares", [[(4, 0), (4, 0)], [(5, 308), (3, 204)], [(6, 384), (2, 128)],
                                    [(3, 200), (2, 100), (3, 212)], [(4, 0), (2, 256)]])
def test_token_shares_train_every_token_of_the_same_global_batch_once(stream: PackedStream,
                                                                      shares: list[tuple[int, int]]) -> None:
    data = GlobalBatches(stream, G)
    plan = token_plan(shares)
    even = token_plan([(4, 0), (4, 0)])
    for step in (0, 3):
        want = Counter((int(a), int(b)) for i in data.sample_ids(step)
                       for a, b in zip(stream.get(i).tokens, stream.get(i).targets))
        got: Counter[tuple[int, int]] = Counter()
        docs = []
        for r, (m, _) in enumerate(shares):
            batch = data.for_replica(step, plan, r)
            assert batch.global_tokens == G * B
            again = data.for_replica(step, plan, r)  # deterministic from (step, plan)
            assert again.documents == batch.documents and again.seqlens == batch.seqlens
            assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(again.microbatches, batch.microbatches))
            docs += list(batch.documents)
            if plan.document_shares:
                assert len(batch.microbatches) == m  # the plan's count: the coordinator reads it
            for mb in batch.microbatches:
                assert sum(mb.seqlens) == mb.num_tokens
                got.update((int(a), int(b)) for a, b in zip(mb.tokens, mb.targets))
        assert got == want  # every (input, target) pair of the batch, once
        if plan.document_shares:
            assert tuple(docs) == data.documents(step)  # the batch's documents, whatever the plan
        assert data.documents(step) == GlobalBatches(stream, G).documents(step)
        assert sum(len(data.for_replica(step, even, r).microbatches) for r in range(2)) == G


def test_token_share_microbatches_are_whole_documents_of_the_stream(stream: PackedStream) -> None:
    data = GlobalBatches(stream, G)
    plan = token_plan([(5, 320), (3, 192)])
    for r in range(2):
        batch = data.for_replica(1, plan, r)
        by_len = iter(batch.documents)
        for mb in batch.microbatches:
            start = 0
            for n in mb.seqlens:
                d = next(d for d in batch.documents if d.length == n and torch.equal(
                    stream.get(d.sample).tokens[d.start:d.start + n], mb.tokens[start:start + n]))
                assert torch.equal(stream.get(d.sample).targets[d.start:d.start + n], mb.targets[start:start + n])
                start += n
        assert sum(mb.num_tokens for mb in batch.microbatches) == sum(d.length for d in by_len)


def test_token_shares_must_add_up_to_the_global_batch(stream: PackedStream) -> None:
    data = GlobalBatches(stream, G)
    with pytest.raises(SpecError, match="token shares sum to 500"):
        data.for_replica(0, token_plan([(4, 300), (4, 200)]), 0)


def test_a_model_without_document_masks_keeps_stream_microbatches_whole(stream: PackedStream) -> None:
    data = GlobalBatches(stream, G, packed=False)
    plan = token_plan([(5, 320), (3, 192)])
    ids = [mb.sample_id for r in range(2) for mb in data.for_replica(2, plan, r).microbatches]
    assert ids == list(data.sample_ids(2))
    assert all(mb is stream.get(mb.sample_id) for mb in data.for_replica(2, plan, 0).microbatches)


def test_whole_share_plans_keep_the_old_split(stream: PackedStream) -> None:
    data = GlobalBatches(stream, G)
    plan = token_plan([(3, 0), (5, 0)])
    assert not plan.document_shares
    assert data.for_replica(4, plan, 1).sample_ids == tuple(range(35, 40))
    assert data.for_replica(4, plan, 1).documents == ()
    assert all(mb is stream.get(mb.sample_id) for mb in data.for_replica(4, plan, 1).microbatches)


def test_the_rest_of_the_runtime_counts_a_token_plan_s_batch_in_tokens() -> None:
    from resihp.coordinator.model.spec import ModelSpec
    from resihp.trainer_hooks.reconfig.failstop import survivor_plan
    from resihp.trainer_hooks.reconfig.world import renumber

    plan = Plan(replicas=(PipelinePlan(((0,), (1,)), (2, 2), 5, 320), PipelinePlan(((2,), (3,)), (2, 2), 2, 192)))
    assert plan.global_microbatches == 7 and plan.batch_microbatches(B) == G
    # a renumbered plan (logical -> group ranks) keeps its token shares
    assert [rep.tokens for rep in renumber(plan, {0: 3, 1: 2, 2: 1, 3: 0}).replicas] == [320, 192]
    # the survivors' rule goes back to whole micro-batches of the same batch
    spec = ModelSpec("t", num_layers=4, hidden=16, num_heads=4, ffn_hidden=32, vocab=256)
    rule = survivor_plan(plan, [0, 1, 2], spec, epoch=1, tokens_per_microbatch=B)
    assert not rule.document_shares and rule.global_microbatches == G


def test_a_replica_short_of_documents_pads_its_count_with_microbatches_that_train_nothing() -> None:
    stream = PackedStream(128, seed=0)  # the demo's stream: whole 128-token pieces of long files
    data = GlobalBatches(stream, G, 128)
    plan = token_plan([(4, 470), (3, 298), (3, 256)])  # 10 micro-batches for a batch of 8
    padded = 0
    for step in range(20):
        docs = data.documents(step)
        trained = 0
        for r, (m, _) in enumerate([(4, 470), (3, 298), (3, 256)]):
            batch = data.for_replica(step, plan, r)
            assert len(batch.microbatches) == m  # the plan's count, whatever the documents
            for mb in batch.microbatches:
                if mb.padding:
                    padded += 1
                    assert mb.seqlens == (1,) and mb.targets.tolist() == [IGNORE]
            trained += batch.tokens
        assert trained == sum(d.length for d in docs) == G * 128
    assert padded > 0, "some step of this stream has fewer documents than the plan's 10 micro-batches"


def test_a_padding_microbatch_adds_exactly_nothing() -> None:
    from resihp.coordinator.model.spec import ModelSpec

    model = GPTStage(ModelSpec("t", num_layers=2, hidden=16, num_heads=4, ffn_hidden=32, vocab=256), 16, (0, 2),
                     True, True)
    model.init_from_seed(0)
    loss = loss_sum(model(torch.tensor([7]), PackedMeta.from_seqlens([1])), torch.tensor([IGNORE]))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
