"""1-bit Adam (Tang et al., arXiv:2102.02888, Algorithm 1; DeepSpeed's `OnebitAdam`).

Warm-up (steps 1..`freeze_step`): plain Adam on gradients the engine all-reduced at full precision —
the same update as torch.optim.AdamW (decoupled weight decay, bias correction), so a run that never
leaves warm-up is AdamW. Compression stage (later steps): the variance v is frozen at its value after
step `freeze_step`; each rank updates its momentum with its *local* gradient, m = β1·m + (1−β1)·g,
and the momenta are averaged with the error-compensated 1-bit all-reduce (`ops.onebit`); then
x ← x·(1 − lr·wd) − lr·m̂/(√v̂_frozen + ε). The engine's gradient all-reduce is off in that stage.

[Note: bias correction] DeepSpeed's 1-bit Adam has none; dstrain keeps Adam's (m̂ = m/(1−β1^t),
v̂ = v/(1−β2^T_w) with T_w = freeze_step) so that warm-up is exactly Adam and the frozen v̂ is unbiased.
"""
from __future__ import annotations

import torch

from .compressed_optimizer import CompressedOptimizer
from .moments import adam_denominator


class OneBitAdam(CompressedOptimizer):
    """Adam with 1-bit compressed momentum after `freeze_step` warm-up steps. `comm`: see
    `CompressedOptimizer`. `cuda_aware` and `comm_backend_name` are DeepSpeed's keys: the collectives
    always go through torch.distributed's backend of the process group (gloo, nccl)."""

    _counters = ("step_count",)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100000, bias_correction: bool = True, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", comm=None, block_size: int = 256):
        if amsgrad:
            raise ValueError("1-bit Adam does not support amsgrad (the variance is frozen after warm-up)")
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the frozen variance needs warm-up steps), got {freeze_step}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, comm, block_size)
        self.freeze_step = int(freeze_step)
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self._frozen_denominators: dict[torch.Tensor, torch.Tensor] = {}

    def needs_gradient_all_reduce(self) -> bool:
        return self.step_count + 1 <= self.freeze_step

    def _update(self) -> None:
        t, warm = self.step_count, self.step_count <= self.freeze_step
        entries = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                if warm:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                entries.append((group, p, state))
        if not warm:
            self.compressed_average_([state["exp_avg"] for _, _, state in entries])
        for group, p, state in entries:
            beta1 = group["betas"][0]
            bc1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], self._denominator(group, p, state, warm), value=-group["lr"] / bc1)

    def _denominator(self, group, p, state, warm: bool) -> torch.Tensor:
        """√v̂ + ε; after warm-up v is frozen, so it is computed once and kept (not checkpointed)."""
        if not warm and p in self._frozen_denominators:
            return self._frozen_denominators[p]
        steps = min(self.step_count, self.freeze_step)
        bc2 = 1 - group["betas"][1] ** steps if group["bias_correction"] else 1.0
        denom = adam_denominator(state["exp_avg_sq"], bc2, group["eps"])
        if not warm:
            self._frozen_denominators[p] = denom
        return denom

    def load_state_dict(self, state_dict: dict) -> None:
        self._frozen_denominators = {}
        super().load_state_dict(state_dict)
