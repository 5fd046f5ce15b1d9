"""The raw-time baselines: they see real slowdowns and also trip on noise resihp ignores."""
from __future__ import annotations

import numpy as np
import pytest

from resihp.sim.detect_baselines import BocdBaseline, ThresholdBaseline


def _series(seed: int, n: int = 120, shift_at: int | None = None, factor: float = 1.5) -> list[float]:
    rng = np.random.default_rng(seed)
    t = 10.0 * np.exp(rng.normal(0.0, 0.01, n))
    if shift_at is not None:
        t[shift_at:] *= factor
    return t.tolist()


@pytest.mark.parametrize("make", [ThresholdBaseline, BocdBaseline])
def test_quiet_series_raises_nothing(make: type) -> None:
    det = make()
    assert not any(det.observe(i, x) for i, x in enumerate(_series(1)))


@pytest.mark.parametrize("make", [ThresholdBaseline, BocdBaseline])
def test_step_up_is_found_quickly_and_once(make: type) -> None:
    det = make()
    alarms = [i for i, x in enumerate(_series(2, shift_at=60)) if det.observe(i, x)]
    assert len(alarms) == 1 and 60 <= alarms[0] <= 63


def test_threshold_trips_on_a_single_stall() -> None:
    series = _series(3)
    series[50] *= 1.3  # a checkpoint stall: not a fail-slow, but raw time cannot tell
    det = ThresholdBaseline()
    assert [i for i, x in enumerate(series) if det.observe(i, x)] == [50]


def test_validation() -> None:
    with pytest.raises(ValueError, match="threshold must be > 0"):
        ThresholdBaseline(threshold=0.0)
    with pytest.raises(ValueError, match="hazard"):
        BocdBaseline(hazard=2.0)
