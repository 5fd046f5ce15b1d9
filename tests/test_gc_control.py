"""The garbage collector off the critical path (trainer_hooks/runtime/gc_control.py): a pause
holds automatic collection off and puts it back as it was, nested and per RESIHP_GC; settling
collects today's garbage and freezes what lives."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from resihp.trainer_hooks.runtime import gc_control


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_a_pause_holds_collection_off_nested_and_puts_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_control.ENV, raising=False)
    gc.enable()
    with gc_control.paused():
        assert not gc.isenabled()
        with gc_control.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still in force
    assert gc.isenabled()
    gc.disable()  # a loop that manages the collector itself keeps it off
    with gc_control.paused():
        pass
    assert not gc.isenabled()


def test_a_pause_puts_collection_back_when_the_block_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_control.ENV, raising=False)
    gc.enable()
    with pytest.raises(RuntimeError, match="peer failed"), gc_control.paused():
        raise RuntimeError("peer failed")
    assert gc.isenabled()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_settling_collects_the_garbage_and_freezes_what_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_control.ENV, raising=False)
    gc.unfreeze()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    kept = [Node() for _ in range(1000)]
    gc_control.settle()
    assert gone() is None
    assert gc.get_freeze_count() >= len(kept)


def test_resihp_gc_off_leaves_the_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gc_control.ENV, "off")
    gc.unfreeze()
    gc.enable()
    with gc_control.paused():
        assert gc.isenabled()
    gc_control.settle()
    assert gc.get_freeze_count() == 0
