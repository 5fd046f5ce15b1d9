"""A store wait that a death notice cuts short (trainer_hooks/launch/store_client.AuthStore's
``interrupt``): a switch sets it, so that gloo's rendezvous stops waiting for a member the
coordinator declared dead instead of waiting out its timeout. Against a real store server,
and a real gloo rendezvous missing its second rank."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from resihp.trainer_hooks.launch import store_server as ss
from resihp.trainer_hooks.launch.store_client import AuthStore
from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure

CREDENTIAL = "k" * 64


@pytest.fixture()
def server() -> Iterator[ss.StoreServer]:
    srv = ss.StoreServer("127.0.0.1", 0, CREDENTIAL).start()
    yield srv
    srv.close()


def test_a_wait_goes_on_until_its_key_comes_while_there_is_no_reason_to_stop(server: ss.StoreServer) -> None:
    store = AuthStore("127.0.0.1", server.port, CREDENTIAL, timedelta(seconds=30))
    other = AuthStore("127.0.0.1", server.port, CREDENTIAL, timedelta(seconds=30))
    asked = threading.Event()

    def interrupt() -> str:
        if asked.is_set():
            other.set("late", "v")  # the key comes while the waiter is between slices
        asked.set()
        return ""

    store.interrupt = interrupt
    assert store.get("late") == b"v"  # several slices: asked, then the key came
    store.wait(["late"])


def test_a_reason_ends_a_wait_at_once_as_a_peer_failure(server: ss.StoreServer) -> None:
    store = AuthStore("127.0.0.1", server.port, CREDENTIAL, timedelta(seconds=300))
    store.interrupt = lambda: "the coordinator declared ranks [6] of epoch 1 dead"
    with pytest.raises(dist.DistStoreError, match=r"wait timeout cut short for keys \['never'\]: the coordinator "
                                                    r"declared ranks \[6\] of epoch 1 dead") as err:
        store.get("never")
    assert is_peer_failure(err.value)


def test_a_timeout_still_ends_a_sliced_wait(server: ss.StoreServer) -> None:
    store = AuthStore("127.0.0.1", server.port, CREDENTIAL, timedelta(milliseconds=300))
    store.interrupt = lambda: ""
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 300ms, keys: \['never'\]"):
        store.get("never")


def test_gloo_s_rendezvous_missing_a_rank_stops_on_the_reason(server: ss.StoreServer) -> None:
    store = AuthStore("127.0.0.1", server.port, CREDENTIAL, timedelta(seconds=120))
    store.interrupt = lambda: "the coordinator declared ranks [1] of epoch 7 dead"
    with pytest.raises(Exception) as err:  # gloo reports the store's error through C++
        dist.init_process_group("gloo", store=PrefixStore("resihp/epoch7/", store), rank=0, world_size=2,
                                timeout=timedelta(seconds=120))
    assert "cut short" in str(err.value) and is_peer_failure(err.value), err.value
    if dist.is_initialized():
        dist.destroy_process_group()
