"""The optimizer a runtime steps: AdamW by default, or the user's, given as a factory.

A live reshard and a checkpoint move an optimizer's state by parameter: they must know which
of its per-parameter entries are tensors shaped like the parameter (AdamW's ``exp_avg`` and
``exp_avg_sq``, SGD's ``momentum_buffer``, Adagrad's ``sum``) and which are its step count.
``probe_states`` learns that once from the factory itself, on a parameter of its own, so
every rank — a spare that holds no state too — names the same states in the same order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from resihp.coordinator.model.spec import SpecError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerStates:
    """What an optimizer keeps per parameter: tensors shaped like it, and its step count
    (``step_tensor``: kept as a float32 0-dim tensor, as Adam's, else a number; ``has_step``
    False for an optimizer that counts none, as SGD)."""

    tensors: tuple[str, ...]
    has_step: bool = True
    step_tensor: bool = True

    def step_value(self, step: float) -> Any:
        return torch.tensor(step, dtype=torch.float32) if self.step_tensor else step


ADAMW_STATES = OptimizerStates(("exp_avg", "exp_avg_sq"))


@cache
def probe_states(factory: OptimizerFactory) -> OptimizerStates:
    """The per-parameter state ``factory``'s optimizer keeps after one step (SpecError when it
    keeps something resihp cannot move: a scalar other than its step, a tensor of another shape)."""
    p = torch.nn.Parameter(torch.zeros(3, 2))
    opt = factory([p])
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    state = opt.state.get(p, {})
    tensors = tuple(sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape))
    others = {k: v for k, v in state.items() if k not in tensors}
    bad = sorted(k for k in others if k != "step")
    if bad:
        raise SpecError(f"optimizer {type(opt).__name__}: its per-parameter state {bad} is neither a tensor shaped like "
                        "the parameter nor its step count; resihp cannot reshard it")
    step = others.get("step")
    return OptimizerStates(tensors, has_step=step is not None,
                           step_tensor=isinstance(step, torch.Tensor) if step is not None else False)


def states_of(factory: OptimizerFactory | None) -> OptimizerStates:
    """The states of ``factory``'s optimizer; AdamW's (the runtime's default) for None."""
    return ADAMW_STATES if factory is None else probe_states(factory)


def state_names(states: OptimizerStates) -> tuple[str, ...]:
    """The reshard's and the checkpoint's states: the parameter, then the optimizer's tensors."""
    return ("param", *states.tensors)


def holds_all(opt_state: dict[str, Any], names: Sequence[str]) -> bool:
    return bool(names) and all(n in opt_state for n in names)
