"""A switch, a step and a poll loop stop waiting for a peer the coordinator declared dead
(trainer_hooks/reporting/deaths.py, reconfig/world.await_arrivals, the pipeline's DeathWatch),
on a real torch store and a real runtime, the notice arriving on another thread."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import HashStore  # pyright: ignore[reportPrivateImportUsage]  # public, not re-exported in its stub

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure
from resihp.trainer_hooks.reconfig.world import (
    SwitchAgreement,
    agree,
    arrival_word,
    await_arrivals,
    death_text,
    parse_arrival_word,
)
from resihp.trainer_hooks.reporting.deaths import DeathNotices, DeathWatch, PeerDeclaredDead


def _cmd(epoch: int, plan: Plan, reason: str) -> m.ReconfigCommand:
    return m.ReconfigCommand(epoch, plan, 10, reason, epoch)


def test_only_fail_stop_plans_newer_than_the_wait_name_the_dead() -> None:
    d = DeathNotices()
    without_3 = Plan.uniform(1, 3, 1, 6, 4)  # ranks 0..2
    d.note(_cmd(2, without_3, "operator excluded rank 3"))  # a planned switch: nobody died
    assert d.dead_among([0, 1, 2, 3], 1) == []
    d.note(_cmd(2, without_3, "fail-stop of ranks [3]; full-replan"))
    assert d.dead_among([0, 1, 2, 3], 1) == [3]
    assert m.failed_ranks("fail-stop of ranks [6, 7]; x") == (6, 7) and m.failed_ranks("fail-slow of ranks [2]") == ()
    assert d.dead_among([0, 1, 2, 3], 2) == []  # the switch to epoch 2 itself leaves 3 out on purpose
    d.clear()
    assert d.dead_among([0, 1, 2, 3], 1) == []


def test_a_waiting_switch_ends_at_once_when_a_member_is_declared_dead() -> None:
    store = HashStore()
    deaths = DeathNotices()
    store.set("resihp/arrive1/1", "1")  # rank 1 arrived; rank 2 never will
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            await_arrivals(store, 1, 0, [0, 1, 2], timeout_s=60.0, deaths=deaths)
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    deaths.note(_cmd(2, Plan.uniform(1, 2, 1, 6, 4), "fail-stop of ranks [2]; full-replan"))
    t.join(30)
    assert not t.is_alive() and len(caught) == 1 and isinstance(caught[0], PeerDeclaredDead)
    assert "the coordinator declared ranks [2] of epoch 1 dead" in str(caught[0]) and is_peer_failure(caught[0])


def test_a_waiting_switch_without_a_coordinator_ends_on_mpis_word_that_a_member_failed() -> None:
    """No death notice ever comes (no coordinator); MPI's list of failed processes
    (``ulfm.failed_processes``, here a stand-in that learns of rank 2 on its third look) ends
    the wait, by name, as a peer failure."""
    store = HashStore()
    store.set("resihp/arrive1/1", "1")  # rank 1 arrived; rank 2 never will
    looks: list[int] = []

    def failed() -> frozenset[int]:
        looks.append(1)
        return frozenset({2, 9}) if len(looks) >= 3 else frozenset()  # 9: not a member, not named

    with pytest.raises(PeerDeclaredDead, match=r"rank 0: MPI reports the processes of ranks \[2\] of epoch 1 failed "
                                               r"while epoch 1's switch waited for them") as caught:
        await_arrivals(store, 1, 0, [0, 1, 2], timeout_s=60.0, deaths=DeathNotices(), failed=failed)
    assert is_peer_failure(caught.value) and len(looks) == 3


def test_the_coordinators_notice_is_named_before_mpis_word() -> None:
    d = DeathNotices()
    d.note(_cmd(3, Plan.uniform(1, 2, 1, 6, 4), "fail-stop of ranks [2]; full-replan"))
    assert death_text([0, 1, 2], 3, d, lambda: frozenset({2})) == "the coordinator declared ranks [2] of epoch 3 dead"
    assert death_text([0, 1, 2], 3, DeathNotices(), lambda: frozenset({2})) == (
        "MPI reports the processes of ranks [2] of epoch 3 failed")
    assert death_text([0, 1], 3, DeathNotices(), lambda: frozenset({2})) == ""
    assert death_text([0, 1, 2], 3, DeathNotices(), None) == ""


def test_every_member_arriving_ends_the_wait_and_a_missing_one_times_out_by_name() -> None:
    store = HashStore()
    for r in (2, 1):  # as await_arrivals itself writes them: the word, then the arrival
        store.append("resihp/arrive3/words", f"word of {r};")  # pyright: ignore[reportAttributeAccessIssue]  # in torch, not in its stub
        store.set(f"resihp/arrive3/{r}", "1")
    # every member's word, in the order they arrived: what the ranks agree on before state moves
    assert await_arrivals(store, 3, 0, [0, 1, 2], timeout_s=5.0, deaths=DeathNotices(), word="mine") == [
        "word of 2", "word of 1", "mine"]
    with pytest.raises(SpecError, match="may not hold ';'"):
        await_arrivals(store, 9, 0, [0], timeout_s=5.0, deaths=DeathNotices(), word="a;b")
    with pytest.raises(RuntimeError, match=r"wait timeout after 0.05 s: ranks \[2\] did not reach epoch 4") as exc:
        await_arrivals(store, 4, 0, [0, 2], timeout_s=0.05, deaths=DeathNotices())
    assert is_peer_failure(exc.value)


def test_a_wait_with_under_a_millisecond_left_still_times_out() -> None:
    # c10d reads a store timeout of 0 ms as "wait for ever": the last slice of a wait must
    # never round down to it (a full CI run hung here when 0.3 ms were left)
    store = HashStore()
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            await_arrivals(store, 5, 0, [0, 2], timeout_s=0.0005, deaths=DeathNotices())
        except RuntimeError as exc:
            caught.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the wait outlived its 0.5 ms timeout by 10 s"
    assert len(caught) == 1 and "ranks [2] did not reach epoch 5" in str(caught[0]), caught


def test_a_rank_hears_of_its_own_death_whatever_its_main_thread_does() -> None:
    d = DeathNotices()
    heard: list[int] = []
    d.on_own_death(3, lambda cmd: heard.append(cmd.epoch))
    d.note(_cmd(2, Plan.uniform(1, 2, 2, 6, 4), "fail-stop of ranks [1]; full-replan"))
    d.note(_cmd(3, Plan.uniform(1, 3, 1, 6, 4), "operator excluded rank 3"))  # a planned switch: alive
    # left out of a fail-stop plan while excluded is not dead (it was killed for that once)
    d.note(_cmd(4, Plan.uniform(1, 2, 1, 6, 4), "fail-stop of ranks [2]; ranks [3] were excluded by the operator"))
    assert heard == []
    d.note(_cmd(5, Plan.uniform(1, 3, 1, 6, 4), "fail-stop of ranks [2, 3]; full-replan"))
    assert heard == [5]


def test_a_step_watch_raises_only_for_a_member_of_its_epoch_declared_dead() -> None:
    d = DeathNotices()
    watch = DeathWatch(0, [0, 1, 2, 3], 4, deaths=d)
    watch()  # nothing heard
    d.note(_cmd(5, Plan.uniform(1, 3, 1, 6, 4), "operator excluded rank 3"))  # alive
    d.note(_cmd(4, Plan.uniform(1, 3, 1, 6, 4), "fail-stop of ranks [3]; full-replan"))  # the epoch it runs: old news
    d.note(_cmd(6, Plan.uniform(1, 3, 1, 6, 4), "fail-stop of ranks [7]; full-replan"))  # not a member
    watch()
    d.note(_cmd(7, Plan.uniform(1, 2, 1, 6, 4), "fail-stop of ranks [2, 3]; full-replan"))
    with pytest.raises(PeerDeclaredDead, match=r"rank 0: the coordinator declared ranks \[2, 3\] of epoch 4 dead") as exc:
        watch()
    assert is_peer_failure(exc.value)


def test_a_poll_loop_wakes_on_a_death_not_at_its_timeout() -> None:
    d = DeathNotices()
    seen = d.version
    assert d.wait(0.01, seen) == seen  # nothing: sleeps its timeout
    woke: list[int] = []
    t = threading.Thread(target=lambda: woke.append(d.wait(60.0, seen)))
    t.start()
    d.note(_cmd(2, Plan.uniform(1, 2, 1, 6, 4), "fail-stop of ranks [2]; full-replan"))
    t.join(30)
    assert not t.is_alive() and woke == [seen + 1]
    assert d.wait(60.0, seen) == seen + 1  # news since ``seen`` returns at once


def test_a_runtime_step_ends_between_ops_when_a_peer_is_declared_dead_and_loses_nothing(world1: None) -> None:
    from resihp.coordinator.model.spec import ModelSpec
    from resihp.trainer_hooks.runtime.trainer import Runtime, TrainConfig

    spec = ModelSpec("gpt-watch", num_layers=2, hidden=16, num_heads=4, ffn_hidden=32, vocab=256)
    plan = Plan.uniform(1, 1, 1, spec.num_layers, 4)
    config = TrainConfig(seed=3, max_seq_len=16)
    reference = Runtime(spec, plan, 0, config).train_step(0).loss
    rt = Runtime(spec, plan, 0, config)
    before = {n: p.detach().clone() for n, p in rt.shards().items()}
    d = DeathNotices()
    watch = DeathWatch(0, [0, 5], 0, deaths=d)  # rank 5: a member of another stage, say
    ops: list[int] = []

    def command_thread_meanwhile() -> None:
        ops.append(len(ops))
        if len(ops) == 3:  # the coordinator's fail-stop plan arrives during the third op
            d.note(_cmd(1, Plan.uniform(1, 1, 1, 2, 4), "fail-stop of ranks [5]; full-replan"))
        watch()

    rt.pipeline.watch = command_thread_meanwhile
    with pytest.raises(PeerDeclaredDead, match=r"ranks \[5\]"):
        rt.train_step(0)
    assert len(ops) == 3  # 4 micro-batches, forward and backward each: 8 ops; it stopped at the third
    assert all(torch.equal(p, before[n]) for n, p in rt.shards().items())  # no optimizer step
    rt.pipeline.watch = lambda: None
    assert rt.train_step(0).loss == reference  # the step, run again, is the step


def test_a_rank_s_arrival_word_round_trips_exactly_and_a_malformed_one_is_named() -> None:
    for keep, moments, steps, step in ((True, False, 0.0, -1), (False, True, 12.0, 7), (True, True, 1e-300, 0),
                                       (True, True, 0.1 + 0.2, 10**9)):
        assert parse_arrival_word(arrival_word(keep, moments, steps, step)) == (keep, moments, steps, step)
    assert parse_arrival_word(arrival_word(True, True, 3.0))[3] == -1  # no step of its own: an idle spare
    with pytest.raises(SpecError, match=r"reads '1', not 'KEEP MOMENTS STEPS NEXT'"):
        parse_arrival_word("1")


def test_the_members_words_agree_whatever_their_order() -> None:
    member = arrival_word(True, True, 12.0, 7)
    spare = arrival_word(True, True, 0.0)  # holds no state: has no moments to miss, no step of its own
    fresh = arrival_word(False, False, 12.0, 7)  # lost its groups; an old holder before its first step
    assert agree([member, spare]) == agree([spare, member]) == SwitchAgreement(True, True, 12.0, 7)
    assert agree([spare, fresh, member]) == SwitchAgreement(False, False, 12.0, 7)
