"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675, Algorithm 2),
with DeepSpeed's FusedLion/CPU Lion defaults (lr 1e-3, betas (0.9, 0.999), weight decay 0):

    c ← β1·m + (1−β1)·g;   x ← x·(1 − lr·wd) − lr·sign(c);   m ← β2·m + (1−β2)·g

Elementwise, so it steps ZeRO's flat partitions exactly (padding: sign(0) = 0 keeps it at zero). One
group's tensors go through torch's foreach ops, i.e. a few kernels over the flat buffers, on whatever
device they live on. State key `exp_avg` (per element, as in DeepSpeed's FusedLion).
"""
from __future__ import annotations

import torch

from .moments import GroupwiseOptimizer


class Lion(GroupwiseOptimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grads = [p.grad for p in params]
        exp_avg = [self.state[p]["exp_avg"] for p in params]
        direction = torch._foreach_lerp(exp_avg, grads, 1 - beta1)  # β1·m + (1−β1)·g
        torch._foreach_sign_(direction)
        if decay:
            torch._foreach_mul_(params, 1 - lr * decay)
        torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_lerp_(exp_avg, grads, 1 - beta2)
