"""Muon with an auxiliary AdamW, as DeepSpeed 0.19 configures `"type": "Muon"` (its `MuonWithAuxAdam`).

Muon (Jordan et al., "Muon: an optimizer for hidden layers", 2024) for a matrix W with gradient G:

    m ← β·m + (1−β)·G;   U = (1−β)·G + β·m (Nesterov);   O = NS5(U)·√max(1, rows/cols)
    W ← W·(1 − lr·wd) − lr·O

NS5 is five steps of the quintic Newton-Schulz iteration X ← aX + (bA + cA²)X, A = XXᵀ, with
(a, b, c) = (3.4445, −4.7750, 2.0315), started from U/(‖U‖_F + 1e-7) (transposed when tall). A tensor
with more than two dims is its (dim 0, rest) matrix. Groups with `use_muon: False` step with Adam(W)
(torch's functional Adam kernel, decoupled decay unless `adam_w_mode` is false).

[Note: whole matrices under ZeRO] The momentum is elementwise, so it lives on ZeRO's flat partitions;
NS5 needs the whole U. ZeRO sets `orthogonalize_flats` (engine/zero/per_tensor.py): every matrix is
orthogonalised once, by one owner rank, and the result goes back to the ranks that hold its fragments.
Without it (stage 0, or a plain model) each matrix is orthogonalised here, whole.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.optim.adam import adam as adam_kernel
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from .moments import evaluate_closure

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = {"standard"}  # DeepSpeed's "gram" form is not built (schemas/optimizer.py MuonParams.ns_method)
MUON_DEFAULTS = dict(lr=0.02, momentum=0.95, weight_decay=0.0)
ADAM_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)


def newton_schulz(update: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS5 of a 2-D `update`, computed in `dtype`, returned in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).float()


def orthogonalized(matrix: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS5(matrix) scaled by √max(1, rows/cols), as DeepSpeed's muon_update."""
    rows, cols = matrix.shape
    return newton_schulz(matrix, dtype).mul_(math.sqrt(rows / cols) if rows > cols else 1.0)


def muon_cost(rows: int, cols: int) -> int:
    """Work of NS5 on a rows×cols matrix, up to a constant: m·n·min(m, n)."""
    return rows * cols * min(rows, cols)


def nesterov_momentum(momentum: torch.Tensor, grad: torch.Tensor, beta: float) -> torch.Tensor:
    """m ← β·m + (1−β)·G in place; returns U = (1−β)·G + β·m (elementwise: slices give slices)."""
    momentum.lerp_(grad, 1 - beta)
    return grad.lerp(momentum, beta)


def apply_muon_update(p: torch.Tensor, update: torch.Tensor, group: dict) -> None:
    """W ← W·(1 − lr·wd) − lr·O (elementwise in W and O)."""
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update.to(p.device), alpha=-group["lr"])


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Param groups carry `use_muon`; missing settings take DeepSpeed's defaults for their half."""

    def __init__(self, param_groups, adam_w_mode: bool = True, ns_dtype: torch.dtype = torch.float32,
                 ns_method: str = "standard"):
        if ns_method not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {sorted(NS_METHODS)}, got {ns_method!r}")
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs a 'use_muon' flag")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            groups.append({**defaults, **group})
        super().__init__(groups, dict())
        self.adam_w_mode, self.ns_dtype = adam_w_mode, ns_dtype
        # ZeRO: (flats, updates) -> updates holding each fragment's slice of its orthogonalised matrix.
        self.orthogonalize_flats: Optional[Callable[[list, list], list]] = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        muon = [(g, p) for g in self.param_groups if g["use_muon"] for p in g["params"] if p.grad is not None]
        updates = [self._nesterov_momentum(g, p) for g, p in muon]
        if self.orthogonalize_flats is not None:
            updates = self.orthogonalize_flats([p for _, p in muon], updates)
        else:
            updates = [orthogonalized(u.reshape(len(u), -1), self.ns_dtype).view_as(p)
                       for (_, p), u in zip(muon, updates)]
        for (group, p), update in zip(muon, updates):
            apply_muon_update(p, update, group)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adam_step(group)
        return loss

    def _nesterov_momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return nesterov_momentum(state["momentum_buffer"], p.grad, group["momentum"])

    def _adam_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        fused_devices = set(_get_fused_kernels_supported_devices())
        fused = all(p.is_floating_point() and p.device.type in fused_devices for p in params)
        for p in params:
            state = self.state[p]
            if not state:
                # torch's rule: the fused kernel reads `step` on the parameter's device, the others on the host
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else torch.device("cpu"))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_kernel(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                    fused=fused or None, decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)
