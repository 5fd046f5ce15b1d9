"""Which per-parameter optimizer state a reshard and a checkpoint move (trainer_hooks/runtime/optim.py):
learned from the optimizer itself, so any ``torch.optim`` optimizer whose state is tensors shaped
like the parameter and a step count can be resharded, and one that keeps more is refused."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.optim import ADAMW_STATES, OptimizerStates, probe_states, state_names


def test_adamw_sgd_adam_amsgrad_and_adagrad_name_their_states() -> None:
    assert probe_states(lambda ps: torch.optim.AdamW(ps, lr=1e-3)) == ADAMW_STATES
    assert probe_states(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) == OptimizerStates(
        ("momentum_buffer",), has_step=False, step_tensor=False)
    assert probe_states(lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True)).tensors == (
        "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    adagrad = probe_states(lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    assert adagrad.tensors == ("sum",) and adagrad.has_step
    plain = probe_states(lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert state_names(plain) == ("param",)  # nothing but the parameters moves
    assert state_names(ADAMW_STATES) == ("param", "exp_avg", "exp_avg_sq")


class _Odd(torch.optim.Optimizer):
    """Keeps a per-parameter value resihp could not reshard (a tensor of another shape)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["row_norms"] = p.grad.norm(dim=1)
                p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_with_state_resihp_cannot_move_is_refused() -> None:
    with pytest.raises(SpecError, match=r"optimizer _Odd: its per-parameter state \['row_norms'\] is neither a tensor"):
        probe_states(_Odd)
