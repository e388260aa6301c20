"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675, Algorithm 2),
with DeepSpeed's FusedLion/CPU Lion defaults (lr 1e-3, betas (0.9, 0.999), weight decay 0):

    c ← β1·m + (1−β1)·g;   x ← x·(1 − lr·wd) − lr·sign(c);   m ← β2·m + (1−β2)·g

Elementwise, so it steps ZeRO's flat partitions exactly (padding: sign(0) = 0 keeps it at zero). State
key `exp_avg` (per element, as in DeepSpeed's FusedLion).

[Note: one pass on CPU] torch has no fused Lion. Over whole tensors the step is five kernels, and `c`
is a fresh tensor the size of the partition: on CPU its pages are faulted in anew every step (glibc
returns large blocks to the OS) and every kernel streams x, g, m from memory again; measured at 1e8
parameters that ran at ~10% of the memory-bandwidth bound (benchmarks/bench_optimizers.py). So on CPU
a large tensor is stepped in blocks of `BLOCK` elements through one reused scratch block: the five
kernels run while the block is in cache, which is one pass over memory (20 bytes per parameter: read
x, g, m; write x, m). Blocks start at multiples of 64 elements, so each element meets the same SIMD
lane as over the whole tensor: the same bits. Small tensors, and every tensor on an accelerator
(where launches cost more than the traffic), go through torch's foreach kernels over the whole tensors.
"""
from __future__ import annotations

import torch

from .moments import GroupwiseOptimizer

BLOCK = 1 << 16  # elements: x, g, m and the scratch block fit a core's L2 (4 x 256 kB)


class Lion(GroupwiseOptimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        blocked = [p for p in params if p.device.type == "cpu" and p.numel() > BLOCK and p.is_contiguous()]
        whole = [p for p in params if all(p is not b for b in blocked)]
        if whole:
            self._foreach_step(group, whole)
        for p in blocked:
            self._blocked_step(group, p)

    def _foreach_step(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        grads = [p.grad for p in params]
        exp_avg = [self.state[p]["exp_avg"] for p in params]
        direction = torch._foreach_lerp(exp_avg, grads, 1 - beta1)  # β1·m + (1−β1)·g
        torch._foreach_sign_(direction)
        if decay:
            torch._foreach_mul_(params, 1 - lr * decay)
        torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_lerp_(exp_avg, grads, 1 - beta2)

    def _blocked_step(self, group: dict, p: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        x, g, m = p.view(-1), p.grad.reshape(-1), self.state[p]["exp_avg"].view(-1)
        scratch = torch.empty(BLOCK, dtype=m.dtype, device=m.device)
        for s in range(0, x.numel(), BLOCK):
            e = min(s + BLOCK, x.numel())
            c = scratch[:e - s].copy_(m[s:e]).lerp_(g[s:e], 1 - beta1)  # the same kernel as torch.lerp(m, g, w)
            c.sign_()
            if decay:
                x[s:e].mul_(1 - lr * decay)
            x[s:e].add_(c, alpha=-lr)
            m[s:e].lerp_(g[s:e], 1 - beta2)
