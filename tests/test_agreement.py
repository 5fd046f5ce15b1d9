"""The boundary agreement (trainer_hooks/reconfig/agreement.py): the pure rule, and rounds on a real TCPStore."""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.agreement import (
    AgreementTimeout,
    BoundaryAgreement,
    Holding,
    common,
    holding_of,
    is_agreed_command,
    is_due,
    round_key,
)

PLAN = Plan.uniform(1, 1, 2, 4, 4)


def reconfig(epoch: int, apply_at: int, reason: str = "planned") -> m.ReconfigCommand:
    return m.ReconfigCommand(epoch=epoch, plan=PLAN, apply_at=apply_at, reason=reason, seq=epoch)


def test_only_planned_switches_and_job_wide_drains_are_agreed() -> None:
    assert is_agreed_command(reconfig(3, 5))
    assert not is_agreed_command(reconfig(3, 5, "fail-stop of ranks [2]; survivors"))
    assert is_agreed_command(m.DrainCommand(epoch=1, apply_at=5))
    assert not is_agreed_command(m.DrainCommand(epoch=1, apply_at=5, ranks=(2,)))
    assert not is_agreed_command(m.ThrottleCommand(epoch=1, factor=2.0, apply_at=5))


def test_holding_is_the_newest_planned_epoch_and_any_job_wide_drain() -> None:
    pending: list[m.Command] = [reconfig(4, 9), reconfig(6, 12), reconfig(9, 3, "fail-stop of ranks [1]"),
                                m.ThrottleCommand(epoch=1, factor=2.0, apply_at=5)]
    assert holding_of(pending, 2, rank=0) == Holding(6, False)
    assert holding_of([], 2, rank=0) == Holding(2, False)
    assert holding_of([m.DrainCommand(epoch=1, apply_at=5)], 2, rank=0) == Holding(2, True)
    # a command for other ranks is not this rank's to hold
    assert holding_of([m.ReconfigCommand(epoch=7, plan=PLAN, apply_at=5, ranks=(1,))], 2, rank=0) == Holding(2, False)


def test_common_is_what_every_member_holds() -> None:
    assert common([Holding(6, True), Holding(4, True), Holding(5, False)]) == Holding(4, False)
    assert common([Holding(6, True), Holding(6, True)]) == Holding(6, True)


@pytest.mark.parametrize("apply_at, next_it, agreed, want", [
    (5, 5, Holding(4, False), True),  # held by all, apply_at reached
    (5, 4, Holding(4, False), False),  # held by all, apply_at ahead
    (5, 9, Holding(3, False), False),  # late, and not every member holds it yet
    (5, 9, Holding(4, False), True),  # late, held by all now: applies at once
    (5, 9, None, False),  # no round this boundary (just switched): never
])
def test_a_switch_is_due_when_its_apply_at_came_and_every_member_holds_it(
        apply_at: int, next_it: int, agreed: Holding | None, want: bool) -> None:
    assert is_due(reconfig(4, apply_at), next_it, agreed) is want


def test_a_drain_is_due_only_when_every_member_holds_one() -> None:
    drain = m.DrainCommand(epoch=1, apply_at=5)
    assert is_due(drain, 6, Holding(1, True))
    assert not is_due(drain, 6, Holding(1, False))
    assert not is_due(drain, 4, Holding(1, True))


def test_a_post_that_is_not_a_holding_says_what_it_is() -> None:
    assert Holding.decode(b"7,1", "k") == Holding(7, True)
    with pytest.raises(ValueError, match=r"store key 'resihp/agree/e1/b2/r0' holds b'hello', not 'EPOCH,DRAIN'"):
        Holding.decode(b"hello", "resihp/agree/e1/b2/r0")


# --- rounds on a real TCPStore ------------------------------------------------------------------
@pytest.fixture
def store() -> Any:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]
    yield master


def _client(store: Any) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]


def _members(store: Any, n: int, timeout_s: float = 10.0) -> list[BoundaryAgreement]:
    return [BoundaryAgreement(lambda: _client(store), rank, timeout_s) for rank in range(n)]


def test_every_member_reads_the_same_common_holding_each_boundary(store: Any) -> None:
    members = _members(store, 3)
    holdings = {0: [Holding(1, False), Holding(5, False), Holding(5, True)],
                1: [Holding(1, False), Holding(1, False), Holding(5, True)],
                2: [Holding(1, False), Holding(5, False), Holding(5, True)]}
    seen: dict[int, list[Holding | None]] = {r: [] for r in range(3)}

    def run(rank: int) -> None:
        a = members[rank]
        seen[rank].append(a.collect())  # nothing posted yet
        for b, h in enumerate(holdings[rank]):
            a.post(3, b, (0, 1, 2), h)
            seen[rank].append(a.collect())
        a.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = [None, Holding(1, False), Holding(1, False), Holding(5, True)]
    assert seen == {0: want, 1: want, 2: want}
    # each member deletes its own post of two boundaries back: only the last two remain
    assert [store.check([round_key(3, b, 0)]) for b in range(3)] == [False, True, True]


def test_a_silent_member_times_out_with_a_failure_the_loop_recovers_from(store: Any) -> None:
    from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure

    a = _members(store, 2, timeout_s=0.6)[0]
    a.post(1, 0, (0, 1), Holding(1, False))  # rank 1 never posts
    with pytest.raises(AgreementTimeout, match=r"Timed out after 1 s waiting for the members' posts of boundary 0 "
                                               r"\(epoch 1\)") as err:
        a.collect(slice_s=0.05)
    assert is_peer_failure(err.value)  # the resilient loop recovers instead of hanging
    # after the timeout the member starts over: a new round on a fresh worker completes
    other = _members(store, 2)[1]
    a.timeout_s = 10.0
    a.post(1, 1, (0, 1), Holding(2, False))
    other.post(1, 1, (0, 1), Holding(3, False))
    assert a.collect() == Holding(2, False) and other.collect() == Holding(2, False)


def test_waiting_stops_when_the_caller_gives_up(store: Any) -> None:
    a = _members(store, 2)[0]
    a.post(1, 0, (0, 1), Holding(1, False))
    asked: list[int] = []

    def give_up() -> bool:
        asked.append(1)
        return len(asked) >= 2  # e.g. the coordinator reported a death while we waited

    assert a.collect(give_up=give_up, slice_s=0.05) is None
    assert len(asked) == 2
    assert a.collect() is None  # the round was dropped


def test_an_abandoned_round_leaves_the_store_when_the_member_closes(store: Any) -> None:
    # a round abandoned after a switch waits for posts that never come; its thread must not be
    # inside a store call when the process exits (that aborts the process: see close)
    a = _members(store, 2, timeout_s=30.0)[0]
    a.post(1, 0, (0, 1), Holding(1, False))  # rank 1 never posts
    assert a.collect(give_up=lambda: True, slice_s=0.05) is None  # abandoned
    a.post(2, 0, (0, 1), Holding(2, False))  # the next epoch's round, on a fresh worker
    workers = [*a._abandoned, a._worker]
    assert len(workers) == 2 and all(w is not None and w.alive() for w in workers)
    assert a.close(timeout_s=2.0) is True
    assert not any(w.alive() for w in workers if w is not None)
    # released by writing in place of the posts that never came; its own posts are untouched
    assert store.get(round_key(1, 0, 1)) == b"abandoned" and store.get(round_key(2, 0, 1)) == b"abandoned"
    assert store.get(round_key(1, 0, 0)) != b"abandoned" and store.get(round_key(2, 0, 0)) != b"abandoned"
