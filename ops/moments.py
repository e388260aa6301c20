"""Pieces of Adam's arithmetic that Lamb and the 1-bit optimizers share."""
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
