"""A switch stops waiting for a peer the coordinator declared dead (trainer_hooks/reporting/
deaths.py, reconfig/live.await_arrivals), on a real torch store with the notice arriving on
another thread while the waiter blocks."""
from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore  # pyright: ignore[reportPrivateImportUsage]  # public, not re-exported in its stub

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.live import await_arrivals
from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure
from resihp.trainer_hooks.reporting.deaths import DeathNotices, PeerDeclaredDead


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
    assert "declared ranks [2] dead" in str(caught[0]) and is_peer_failure(caught[0])


def test_every_member_arriving_ends_the_wait_and_a_missing_one_times_out_by_name() -> None:
    store = HashStore()
    for r in (1, 2):
        store.set(f"resihp/arrive3/{r}", "1")
    await_arrivals(store, 3, 0, [0, 1, 2], timeout_s=5.0, deaths=DeathNotices())
    with pytest.raises(RuntimeError, match=r"wait timeout after 0.05 s: ranks \[2\] did not reach epoch 4") as exc:
        await_arrivals(store, 4, 0, [0, 2], timeout_s=0.05, deaths=DeathNotices())
    assert is_peer_failure(exc.value)


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
