"""1-bit LAMB (Li et al., arXiv:2104.06069, Algorithm 1; DeepSpeed's `OnebitLamb`).

Warm-up (steps 1..`freeze_step`): LAMB (`ops.lamb`) on full-precision averaged gradients, tracking an
EMA of each tensor's trust ratio, c̄ ← β_c·c̄ + (1−β_c)·c (`coeff_beta`; skipped when c = 1).
Compression stage:
- At its first step each tensor gets a scaling coefficient s = (mean over tensors of ‖m‖/√n)/(‖m‖/√n),
  so every momentum has about the same scale and all of them share one flat 1-bit all-reduce.
- m ← β1·m + (1−β1)·g_local; m·s is averaged with the 1-bit all-reduce; then m /= s.
- v stays frozen for the update, but a fresh v is kept from the gradient the averaged momenta imply,
  ĝ = (m_t − β1·m_{t−1})/(1−β1). The trust ratio is the frozen one times a factor
  f = max(√v̂_frozen+ε)/(√v̂_fresh+ε) (blended with 1 by ‖m̂/(√v̂+ε)‖/‖update‖ when wd > 0), clipped
  to [factor_min, factor_max] and to ±factor_threshold of the previous step's f.
Bias correction as in `ops.onebit_adam` (warm-up is exactly `ops.lamb.Lamb`).
"""
from __future__ import annotations

import torch

from .compressed_optimizer import CompressedOptimizer
from .lamb import lamb_update
from .moments import adam_denominator


class OneBitLamb(CompressedOptimizer):
    _counters = ("step_count",)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100000, bias_correction: bool = True, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", comm=None, block_size: int = 256):
        if amsgrad:
            raise ValueError("1-bit LAMB does not support amsgrad (the variance is frozen after warm-up)")
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the frozen variance needs warm-up steps), got {freeze_step}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, comm, block_size)
        self.freeze_step, self.coeff_beta = int(freeze_step), coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name

    def needs_gradient_all_reduce(self) -> bool:
        return self.step_count + 1 <= self.freeze_step

    def _entries(self):
        return [(g, p, self.state[p]) for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _update(self) -> None:
        entries = self._entries()
        if self.step_count <= self.freeze_step:
            self._warmup_step(entries)
        else:
            self._compressed_step(entries)

    def _warmup_step(self, entries) -> None:
        for group, p, state in entries:
            coeff = lamb_update(p, p.grad, state, group, self.step_count)
            frozen = state.setdefault("lamb_coeff_freeze", torch.zeros(()))
            ema = frozen * self.coeff_beta + coeff * (1 - self.coeff_beta)
            state["lamb_coeff_freeze"] = torch.where(coeff != 1.0, ema, frozen)
            state.setdefault("last_factor", torch.ones(()))
            if self.step_count == self.freeze_step:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()

    def _momentum_scaling(self, entries) -> None:
        """s per tensor (paper §4.2): brings every momentum to the mean scale before sharing one compressor."""
        scales = torch.stack([torch.linalg.vector_norm(s["exp_avg"]) / s["exp_avg"].numel() ** 0.5
                              for _, _, s in entries])
        united = scales.mean()
        for (_, _, state), scale in zip(entries, scales):
            state["scaling_coeff"] = torch.where(scale > 0, united / scale.clamp_min(1e-30), torch.ones(()))

    def _compressed_step(self, entries) -> None:
        if "scaling_coeff" not in entries[0][2]:
            self._momentum_scaling(entries)
        previous = [state["exp_avg"].clone() for _, _, state in entries]
        for group, p, state in entries:
            state["exp_avg"].lerp_(p.grad, 1 - group["betas"][0]).mul_(state["scaling_coeff"])
        self.compressed_average_([state["exp_avg"] for _, _, state in entries])
        for (group, p, state), m_prev in zip(entries, previous):
            state["exp_avg"].div_(state["scaling_coeff"])
            self._apply(group, p, state, m_prev)

    def _apply(self, group, p, state, m_prev) -> None:
        beta1, beta2 = group["betas"]
        m, t = state["exp_avg"], self.step_count
        grad = (m - m_prev * beta1) / (1 - beta1)
        state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        correct = group["bias_correction"]
        denom = adam_denominator(state["exp_avg_sq"], 1 - beta2 ** self.freeze_step if correct else 1.0, group["eps"])
        fresh = adam_denominator(state["exp_avg_sq_fresh"], 1 - beta2 ** t if correct else 1.0, group["eps"])
        prelim = (m / (1 - beta1 ** t if correct else 1.0)).div_(denom)
        update = prelim + p * group["weight_decay"] if group["weight_decay"] else prelim
        factor = (denom / fresh).max()
        if group["weight_decay"]:
            ratio = torch.linalg.vector_norm(prelim) / torch.linalg.vector_norm(update).clamp_min(1e-30)
            ratio = ratio.clamp(max=1.0)
            factor = factor * ratio + (1.0 - ratio)
        last = state["last_factor"]
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = factor.clamp(last * (1 - self.factor_threshold), last * (1 + self.factor_threshold))
        state["last_factor"] = factor
        p.sub_(update * (state["lamb_coeff_freeze"] * factor * group["lr"]))
