"""Resilience policies the simulator compares. ``make(name, ...)`` builds one by name."""
from __future__ import annotations

from collections.abc import Callable

from resihp.sim.perf import JobSpec, PerfModel
from resihp.sim.policies.base import Policy, Settings
from resihp.sim.policies.failslow import Adaptra, Greyhound
from resihp.sim.policies.oobleck import Oobleck
from resihp.sim.policies.recycle import ReCycle
from resihp.sim.policies.restart import CheckpointRestart, Static

Factory = Callable[[JobSpec, PerfModel, Settings], Policy]

BASELINES: dict[str, Factory] = {
    "static": lambda j, p, s: Static(j, p, s),
    "ckpt-restart": lambda j, p, s: CheckpointRestart(j, p, s, spare=False),
    "ckpt-restart+spare": lambda j, p, s: CheckpointRestart(j, p, s, spare=True),
    "oobleck": lambda j, p, s: Oobleck(j, p, s),
    "recycle": lambda j, p, s: ReCycle(j, p, s),
    "greyhound": lambda j, p, s: Greyhound(j, p, s),
    "adaptra": lambda j, p, s: Adaptra(j, p, s),
}


# resihp started from the job's given layout (``resihp launch`` with a fixed layout) rather than
# its planner's launch layout (``--layout auto``): what resihp's resilience alone is worth
GIVEN_LAYOUT = "resihp@given"


def names() -> list[str]:
    return list(BASELINES) + ["resihp"]


def known() -> list[str]:
    """Every name ``make`` takes: the policies ``names()`` runs by default and resihp's variants."""
    return names() + [GIVEN_LAYOUT]


def is_resihp(name: str) -> bool:
    """resihp or one of its variants: never a baseline."""
    return name == "resihp" or name.startswith("resihp@")


def make(name: str, job: JobSpec, perf: PerfModel, settings: Settings) -> Policy:
    if is_resihp(name):
        from resihp.sim.policies.resihp import ResiHP

        if name not in ("resihp", GIVEN_LAYOUT):
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(known())}")
        pol = ResiHP(job, perf, settings, auto_layout=name == "resihp")
        pol.name = name
        return pol
    try:
        return BASELINES[name](job, perf, settings)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(known())}") from None


__all__ = ["Policy", "Settings", "make", "names", "known", "is_resihp", "BASELINES", "GIVEN_LAYOUT"]
