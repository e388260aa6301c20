"""LAMB (You et al., arXiv:1904.00962, Algorithm 2; DeepSpeed's `FusedLamb` params and defaults).

update = m̂/(√v̂ + ε) + wd·x;  trust ratio r = ‖x‖/‖update‖ clipped to [min_coeff, max_coeff]
(1 when either norm is 0);  x ← x − lr·r·update. Per parameter tensor. The trust ratio stays a
tensor: no host sync per parameter.

[Note: blocks] Under ZeRO a flat is stepped in two passes of `BLOCK`-element blocks (`_segmented_step`)
rather than by whole-flat kernels: on CPU each block's moments, update and squares stay in cache, so a
pass streams x, g, m, v once instead of once per kernel, and no partition-sized temporaries are made
(their pages are faulted in anew every step). The NVMe step (engine/zero/nvme_per_tensor.py) runs the
same two passes over its sub-groups. Stage 0 steps each tensor whole (`lamb_update`).

[Note: per tensor under ZeRO] Under ZeRO stages 1-3 a group's "parameter" is a flat partition holding
dim-0 chunks of many tensors. ZeRO sets `segmented` (ops.tensor_segments) and the ratio is taken per
original tensor: the partial Σx² and Σu² of every fragment go into one vector that is summed over
ranks once per step, then each element gets the ratio of its own tensor. DeepSpeed's FusedLamb takes
the norms of the flat chunk instead (its issue #88), which is neither the paper's rule nor stable
across world sizes.
"""
from __future__ import annotations

import torch

from .moments import adam_denominator, evaluate_closure
from .tensor_segments import SegmentedReduction


def clipped_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, max_coeff: float, min_coeff: float) -> torch.Tensor:
    """‖x‖/‖u‖ clipped to [min_coeff, max_coeff]; 1 where either norm is 0 (elementwise over vectors too)."""
    ratio = (w_norm / u_norm.clamp_min(torch.finfo(u_norm.dtype).tiny)).clamp(min_coeff, max_coeff)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


def trust_ratio(param: torch.Tensor, update: torch.Tensor, max_coeff: float, min_coeff: float) -> torch.Tensor:
    return clipped_ratio(torch.linalg.vector_norm(param), torch.linalg.vector_norm(update), max_coeff, min_coeff)


def advance_moments(state: dict, grad: torch.Tensor, group: dict, like: torch.Tensor) -> None:
    """m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g² in place (zeros like `like` at the first step)."""
    beta1, beta2 = group["betas"]
    if "exp_avg" not in state:
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(like), torch.zeros_like(like)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def direction_from_moments(p: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """The unscaled LAMB update m̂/(√v̂ + ε) + wd·x from moments already advanced to `step` (a new
    tensor; elementwise, so any slice of `p` and its moments gives that slice of the update)."""
    beta1, beta2 = group["betas"]
    bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
    bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
    update = (state["exp_avg"] / bc1).div_(adam_denominator(state["exp_avg_sq"], bc2, group["eps"]))
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    return update


def lamb_direction(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """Advance the moments of `p` and return its unscaled LAMB update m̂/(√v̂ + ε) + wd·x."""
    advance_moments(state, grad, group, p)
    return direction_from_moments(p, state, group, step)


def apply_ratio(p: torch.Tensor, update: torch.Tensor, ratio: torch.Tensor, lr: float) -> None:
    """x ← x − lr·r·update, with `ratio` a scalar or one ratio per element of `p`."""
    p.sub_(update * (ratio.to(p.device) * lr))


def lamb_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """One LAMB step of a whole tensor `p` in place; returns the trust ratio used (0-dim tensor)."""
    update = lamb_direction(p, grad, state, group, step)
    coeff = trust_ratio(p, update, group["max_coeff"], group["min_coeff"])
    p.sub_(update * (coeff * group["lr"]))
    return coeff


class Lamb(torch.optim.Optimizer):
    """LAMB with Adam moments, decoupled weight decay inside the trust ratio, and coefficient clipping."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.segmented: SegmentedReduction | None = None  # set by ZeRO (module note)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        if self.segmented is None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        lamb_update(p, p.grad, self.state[p], group, advance_step(self.state[p]))
            return loss
        self._segmented_step()
        return loss

    def _segmented_step(self) -> None:
        """Two passes over each flat, block by block (module note: blocks): pass 1 advances the moments,
        forms the update and adds its tensor's x² and u² into the partial sums; after the one reduction,
        pass 2 forms the update again from the moments (the same arithmetic on the same values: the same
        bits, no partition-sized update kept) and applies its tensor's ratio."""
        items = [(group, p, advance_step(self.state[p])) for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        count = self.segmented.count
        device = self.segmented.segments[next(iter(self.segmented.segments))].ids.device
        partial = torch.zeros(2 * count, dtype=torch.float32, device=device)
        for group, p, step in items:
            state, ids = self.state[p], self.segmented.segments[p].ids
            if "exp_avg" not in state:
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            for s, e in blocks(p):
                moments = {k: state[k][s:e] for k in ("exp_avg", "exp_avg_sq")}
                advance_moments(moments, p.grad[s:e], group, p[s:e])
                update = direction_from_moments(p[s:e], moments, group, step)
                partial[:count].index_add_(0, ids[s:e], p[s:e].detach().float().square().to(device))
                partial[count:].index_add_(0, ids[s:e], update.float().square().to(device))
        total = self.segmented.all_reduce_sum(partial)
        w_norm, u_norm = total[:count].sqrt(), total[count:].sqrt()
        for group, p, step in items:
            state, ids = self.state[p], self.segmented.segments[p].ids
            ratio = clipped_ratio(w_norm, u_norm, group["max_coeff"], group["min_coeff"])
            for s, e in blocks(p):
                moments = {k: state[k][s:e] for k in ("exp_avg", "exp_avg_sq")}
                apply_ratio(p[s:e], direction_from_moments(p[s:e], moments, group, step), ratio[ids[s:e]], group["lr"])


BLOCK = 1 << 16  # elements per block on CPU (module note)


def blocks(flat: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) blocks of a 1-D flat: BLOCK elements on CPU (a multiple of 64, so every element meets
    the SIMD lane it meets over the whole flat: the same bits), the whole flat on an accelerator, where
    a launch per block costs more than the traffic saved."""
    n = flat.numel()
    if flat.device.type != "cpu":
        return [(0, n)]
    return [(s, min(s + BLOCK, n)) for s in range(0, n, BLOCK)]


def advance_step(state: dict) -> int:
    """Count this tensor's steps in its state (a host scalar, as torch's `step`), so that checkpoints,
    which save per-parameter state, resume the bias correction where it was."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=torch.device("cpu"))  # read on the host
    state["step"] += 1
    return int(state["step"])
