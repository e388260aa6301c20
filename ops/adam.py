"""Adam/AdamW without bias correction: DeepSpeed's `FusedAdam(bias_correction=False)` (and CPU Adam's).

    m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²        (v_max ← max(v_max, v) with amsgrad)
    AdamW (adam_w_mode):  x ← x − lr·(m/(√v + ε) + wd·x)
    Adam  (L2):           g ← g + wd·x before the moments;  x ← x − lr·m/(√v + ε)

That is torch's Adam/AdamW with both bias-correction factors 1 − β^t replaced by 1, which no torch
kernel offers. The moments therefore start biased towards 0: the first steps are smaller than Adam's
(the first is lr·(1−β1)/√(1−β2) per element, ~3.2·lr with the default betas, rather than lr). State keys
are torch's (`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`), so ZeRO partitions and checkpoints
treat it as they treat torch's Adam. One group's tensors are updated with torch's foreach ops.
"""
from __future__ import annotations

import torch

from .moments import GroupwiseOptimizer


class UncorrectedAdam(GroupwiseOptimizer):
    """Adam (adam_w_mode=False, L2 decay) or AdamW (adam_w_mode=True) with bias_correction=False."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adam_w_mode: bool = True):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        adam_w_mode=adam_w_mode)
        super().__init__(params, defaults)

    def _state_of(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay, amsgrad = group["lr"], group["eps"], group["weight_decay"], group["amsgrad"]
        states = [self._state_of(p, amsgrad) for p in params]
        grads = [p.grad for p in params]
        if decay and not group["adam_w_mode"]:
            grads = torch._foreach_add(grads, params, alpha=decay)  # L2: the decay enters the moments
        exp_avg, exp_avg_sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        second = exp_avg_sq
        if amsgrad:
            second = [s["max_exp_avg_sq"] for s in states]
            torch._foreach_maximum_(second, exp_avg_sq)
        denom = torch._foreach_sqrt(second)
        torch._foreach_add_(denom, eps)
        if decay and group["adam_w_mode"]:
            torch._foreach_mul_(params, 1 - lr * decay)  # x − lr·wd·x, with x before this step's update
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-lr)
        for s in states:
            s["step"] += 1
