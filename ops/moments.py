"""Pieces of Adam's arithmetic that Lamb and the 1-bit optimizers share, and the per-group step loop of
the foreach optimizers (UncorrectedAdam, Lion)."""
from __future__ import annotations

import math

import torch


def adam_denominator(exp_avg_sq: torch.Tensor, bias_correction2: float, eps: float) -> torch.Tensor:
    """√v̂ + ε in torch's rounding order (√v/√(1−β2^t) + ε), so warm-up matches torch's AdamW."""
    return (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)


def evaluate_closure(closure):
    """torch.optim's closure protocol: re-evaluate the loss with autograd on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class GroupwiseOptimizer(torch.optim.Optimizer):
    """`step()` hands each param group's parameters that have a gradient to `_step_group`, which
    updates them together (one foreach call per state tensor)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError
