"""Reruns that judge a fresh recording (for tests of timings on shared cores)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def fresh_on_rerun(request: pytest.FixtureRequest, first: T, remake: Callable[[], T]) -> T:
    """``first`` (a module fixture's recorded run) on a test's first try; on a rerun (the flaky
    mark) a fresh run from ``remake``. pytest-rerunfailures re-runs only fixtures that failed,
    so without this a rerun would judge the same noisy recording again and fail the same way."""
    if getattr(request.node, "execution_count", 1) <= 1:
        return first
    return remake()
