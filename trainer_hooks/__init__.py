"""The two calls a training loop adds, and the runtime they reshape.

    job = resihp.trainer_hooks.init("gpt-tiny", plan)   # once, at start-up
    job.step(result)                                    # once per iteration

Sub-packages: ``runtime`` (the hybrid-parallel runtime and resilient loop), ``usermodel`` (a
user's own model: layout spec, Hugging Face plans, stages cut from it), ``reconfig``
(live reconfiguration and fail-stop recovery), ``checkpoint``, ``reporting`` (reports to the
agent, traces) and ``launch`` (``resihp launch`` and the MPI bootstrap). See docs/runtime.md.
Heavy imports (torch, mpi4py, grpc) happen on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what tools and editors resolve; at run time the names load on first use
    from resihp.trainer_hooks.hooks import Job, StepOutcome, init, step
    from resihp.trainer_hooks.runtime.autolayout import AutoLayout
    from resihp.trainer_hooks.runtime.trainer import TrainConfig

__all__ = ["init", "step", "Job", "StepOutcome", "TrainConfig", "AutoLayout"]


def __getattr__(name: str) -> Any:
    if name in ("init", "step", "Job", "StepOutcome"):
        from resihp.trainer_hooks import hooks

        return getattr(hooks, name)
    if name == "AutoLayout":
        from resihp.trainer_hooks.runtime.autolayout import AutoLayout

        return AutoLayout
    if name == "TrainConfig":
        from resihp.trainer_hooks.runtime.trainer import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'resihp.trainer_hooks' has no attribute {name!r}")
