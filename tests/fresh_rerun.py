"""Reruns that judge a fresh recording (for tests of timings on shared cores)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def fresh_on_rerun(request: pytest.FixtureRequest, first: T, remake: Callable[[], T]) -> T:
    """``first`` (a module fixture's recorded run) on a test's first try; on a rerun (the flaky
    mark) a fresh run from ``remake``. pytest-rerunfailures re-runs only fixtures that failed,
    so without this a rerun would judge the same noisy recording again and fail the same way."""
    if getattr(request.node, "execution_count", 1) <= 1:
        return first
    return remake()


def recorded_once(record: Callable[[], AbstractContextManager[T]]) -> T:
    """What a recording context yields, once it has run to its end (its teardown included):
    the ``remake`` of ``fresh_on_rerun`` for a module fixture written as a context manager."""
    with record() as got:
        return got


def recording_fixtures(record: Callable[[pytest.TempPathFactory], AbstractContextManager[T]], name: str
                       ) -> tuple[Any, Any]:
    """Two fixtures for a module whose tests judge one recorded run: ``first_<name>`` (module
    scope: the run, recorded once) and ``<name>`` (what a test takes: that run, or on a rerun a
    fresh one). ``record``: a context manager yielding the run, its teardown on exit."""
    first_name = f"first_{name}"

    @pytest.fixture(scope="module", name=first_name)
    def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[T]:
        with record(tmp_path_factory) as got:
            yield got

    @pytest.fixture(name=name)
    def fresh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> T:
        return fresh_on_rerun(request, request.getfixturevalue(first_name),
                              lambda: recorded_once(lambda: record(tmp_path_factory)))

    return first, fresh


def run_fixtures(make: Callable[[pytest.TempPathFactory], T], name: str) -> tuple[Any, Any]:
    """``recording_fixtures`` for a run that needs no teardown: ``make`` returns it."""

    @contextmanager
    def record(factory: pytest.TempPathFactory) -> Iterator[T]:
        yield make(factory)

    return recording_fixtures(record, name)
