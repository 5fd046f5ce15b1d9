"""The two calls a training loop adds, and the runtime they reshape.

    job = resihp.trainer_hooks.init("gpt-tiny", plan)   # once, at start-up
    job.step(result)                                    # once per iteration

See docs/runtime.md. Heavy imports (torch, mpi4py, grpc) happen on first use.
"""
from __future__ import annotations

from typing import Any

__all__ = ["init", "step", "Job", "StepOutcome", "TrainConfig"]


def __getattr__(name: str) -> Any:
    if name in ("init", "step", "Job", "StepOutcome"):
        from resihp.trainer_hooks import hooks

        return getattr(hooks, name)
    if name == "TrainConfig":
        from resihp.trainer_hooks.runtime.trainer import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'resihp.trainer_hooks' has no attribute {name!r}")
