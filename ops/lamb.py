"""LAMB (You et al., arXiv:1904.00962, Algorithm 2; DeepSpeed's `FusedLamb` params and defaults).

update = m̂/(√v̂ + ε) + wd·x;  trust ratio r = ‖x‖/‖update‖ clipped to [min_coeff, max_coeff]
(1 when either norm is 0);  x ← x − lr·r·update. Per parameter tensor. The trust ratio stays a
tensor: no host sync per parameter.

[Note: blocks] A flat (ZeRO) and a large fp32 tensor on the host (stage 0) are stepped in two passes of
`BLOCK`-element blocks (`two_pass_step`) rather than by whole-tensor kernels: on CPU each block's
moments, update and squares stay in cache, so a pass streams x, g, m, v once instead of once per
kernel, and no tensor-sized temporaries are made (their pages are faulted in anew every step). The
NVMe step (engine/zero/nvme_per_tensor.py) runs the same two passes over its sub-groups. The other
tensors of a group step in batches, one foreach call per operation and one norm computation per batch
(`_foreach_step`: the same kernels per tensor as the whole-tensor `lamb_update`, hence its bits): on
an accelerator the whole group (foreach kernels are fused there); on CPU, where a foreach call is a loop
of per-tensor kernels, runs of consecutive tensors of up to BLOCK elements, so that each batch's ~12
kernels still find it in cache while the Python cost is paid once per batch, not per tensor.

[Note: per tensor under ZeRO] Under ZeRO stages 1-3 a group's "parameter" is a flat partition holding
dim-0 chunks of many tensors. ZeRO sets `segmented` (ops.tensor_segments) and the ratio is taken per
original tensor: the partial Σx² and Σu² of every fragment go into one vector that is summed over
ranks once per step, then each fragment is scaled by the ratio of its own tensor (tensor_segments'
rows note: one sum and one scale per 64-element row, no per-element index). DeepSpeed's FusedLamb
takes the norms of the flat chunk instead (its issue #88), which is neither the paper's rule nor
stable across world sizes.
"""
from __future__ import annotations

import math

import torch

from .moments import adam_denominator, evaluate_closure
from .tensor_segments import FlatRuns, SegmentedReduction

MOMENTS = ("exp_avg", "exp_avg_sq")


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


def bias_corrections(group: dict, step: int) -> tuple[float, float]:
    beta1, beta2 = group["betas"]
    if not group["bias_correction"]:
        return 1.0, 1.0
    return 1 - beta1 ** step, 1 - beta2 ** step


def direction_from_moments(p: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """The unscaled LAMB update m̂/(√v̂ + ε) + wd·x from moments already advanced to `step` (a new
    tensor; elementwise, so any slice of `p` and its moments gives that slice of the update)."""
    bc1, bc2 = bias_corrections(group, step)
    update = (state["exp_avg"] / bc1).div_(adam_denominator(state["exp_avg_sq"], bc2, group["eps"]))
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    return update


def lamb_direction(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """Advance the moments of `p` and return its unscaled LAMB update m̂/(√v̂ + ε) + wd·x."""
    advance_moments(state, grad, group, p)
    return direction_from_moments(p, state, group, step)


def lamb_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
    """One LAMB step of a whole tensor `p` in place; returns the trust ratio used (0-dim tensor)."""
    update = lamb_direction(p, grad, state, group, step)
    coeff = trust_ratio(p, update, group["max_coeff"], group["min_coeff"])
    p.sub_(update * (coeff * group["lr"]))
    return coeff


def scaled_ratios(group: dict, w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """lr·r per tensor: what each element's update is multiplied by."""
    return clipped_ratio(w_norm, u_norm, group["max_coeff"], group["min_coeff"]) * group["lr"]


def two_pass_step(items: list, count: int, all_reduce_sum) -> None:
    """items: (group, x, grad, state, step, runs), x a 1-D flat (or a tensor's view), its grad and state
    alike, `runs` its FlatRuns over tensor indices in [0, count). Pass 1, block by block: advance the
    moments, form the update, add each tensor's x² and u² into the partial sums; after the one
    reduction, pass 2 forms the update again from the moments (the same arithmetic on the same
    values: the same bits, no flat-sized update kept) and applies its tensor's ratio (module notes)."""
    partial = torch.zeros(2 * count, dtype=torch.float32, device=items[0][5].device)
    for group, x, grad, state, step, runs in items:
        for s, e in blocks(x):
            moments = {k: state[k][s:e] for k in MOMENTS}
            advance_moments(moments, grad[s:e], group, x[s:e])
            update = direction_from_moments(x[s:e], moments, group, step)
            plan = runs.plan(s, e)
            plan.add_squares(partial[:count], x[s:e])
            plan.add_squares(partial[count:], update)
    total = all_reduce_sum(partial)
    w_norm, u_norm = total[:count].sqrt(), total[count:].sqrt()
    for group, x, grad, state, step, runs in items:
        scaled = scaled_ratios(group, w_norm, u_norm)
        for s, e in blocks(x):
            update = direction_from_moments(x[s:e], {k: state[k][s:e] for k in MOMENTS}, group, step)
            x[s:e].sub_(runs.plan(s, e).scale(update, scaled))


class Lamb(torch.optim.Optimizer):
    """LAMB with Adam moments, decoupled weight decay inside the trust ratio, and coefficient clipping."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.segmented: SegmentedReduction | None = None  # set by ZeRO (module note)
        self._whole_runs: dict = {}  # blocked whole tensor -> (its index this step, its FlatRuns)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        if self.segmented is None:
            self._tensor_step()
        else:
            self._segmented_step()
        return loss

    def _segmented_step(self) -> None:
        items = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    step = advance_step(state)
                    if "exp_avg" not in state:
                        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    items.append((group, p, p.grad, state, step, self.segmented.segments[p]))
        if items:
            two_pass_step(items, self.segmented.count, self.segmented.all_reduce_sum)

    def _tensor_step(self) -> None:
        """Whole tensors (stage 0): large fp32 host tensors in blocks, the rest batched per group."""
        blocked = []
        for group in self.param_groups:
            batched: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, step = self.state[p], advance_step(self.state[p])
                if "exp_avg" not in state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                if _blockable(p, state):
                    blocked.append((group, p, state, step))
                else:
                    batched.setdefault((p.device, p.dtype), []).append((p, state, step))
            for members in batched.values():
                for batch in _batches(members):
                    _foreach_step(group, batch)
        if blocked:
            items = [(group, p.view(-1), p.grad.view(-1), {k: state[k].view(-1) for k in MOMENTS}, step,
                      self._runs_of(p, i)) for i, (group, p, state, step) in enumerate(blocked)]
            two_pass_step(items, len(items), lambda v: v)

    def _runs_of(self, p: torch.Tensor, index: int) -> FlatRuns:
        """One run: the whole tensor, tensor `index` (its plans kept while the index stays)."""
        held = self._whole_runs.get(p)
        if held is None or held[0] != index:
            held = self._whole_runs[p] = (index, FlatRuns([(0, p.numel(), index)], p.device, cache=True))
        return held[1]


def _blockable(p: torch.Tensor, state: dict) -> bool:
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.numel() > BLOCK and p.is_contiguous()
            and p.grad.is_contiguous() and all(state[k].is_contiguous() for k in MOMENTS))


def _batches(members: list) -> list[list]:
    """(param, state, step) of one device and dtype in batches (module note: blocks)."""
    if members[0][0].device.type != "cpu":
        return [members]
    batches, size = [], BLOCK + 1
    for member in members:
        if size + member[0].numel() > BLOCK:
            batches.append([])
            size = 0
        batches[-1].append(member)
        size += member[0].numel()
    return batches


def _foreach_step(group: dict, members: list) -> None:
    """`lamb_update` for every tensor of one device and dtype at once (module note: blocks)."""
    params, states, steps = zip(*members)
    grads = [p.grad for p in params]
    exp_avg, exp_avg_sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    beta1, beta2 = group["betas"]
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    corrections = [bias_corrections(group, step) for step in steps]
    updates = torch._foreach_div(exp_avg, [bc1 for bc1, _ in corrections])
    denominators = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denominators, [math.sqrt(bc2) for _, bc2 in corrections])
    torch._foreach_add_(denominators, group["eps"])
    torch._foreach_div_(updates, denominators)
    if group["weight_decay"]:
        torch._foreach_add_(updates, list(params), alpha=group["weight_decay"])
    w_norm, u_norm = torch.stack(torch._foreach_norm(list(params))), torch.stack(torch._foreach_norm(updates))
    torch._foreach_mul_(updates, list(scaled_ratios(group, w_norm, u_norm).unbind(0)))
    torch._foreach_sub_(list(params), updates)


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
