"""fp32 master weights for fp16/bf16 models at stage 0.

The optimizer steps fp32 copies of the parameters, laid out exactly like the gradient buckets' flat
buffers (same dtype groups, same order), so moving gradients in is one copy per dtype group and
unscaling is one multiply. The optimizer's param groups are rewired to the master copies, so its
state is fp32 and its hyperparameters stay where the user put them.
"""
from __future__ import annotations

import torch

from offload.huge_pages import flat_empty, flat_zeros

from .arrivals import dense_view
from .buckets import GradientBuckets


class MasterWeights:
    def __init__(self, optimizer: torch.optim.Optimizer, buckets: GradientBuckets):
        if optimizer.state:
            raise ValueError("the optimizer already has state; mixed precision needs a fresh optimizer "
                             "(its state must be built over the fp32 master weights)")
        self.buckets = buckets
        self.model_params: list[torch.nn.Parameter] = []
        self.master_params: list[torch.nn.Parameter] = []
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        self.flat_grad: dict[torch.dtype, torch.Tensor] = {}
        master_of: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        for dtype, members in buckets.members.items():
            grads_in_fp32 = buckets.flat[dtype].dtype == torch.float32
            flat = flat_empty(buckets.flat[dtype].numel(), torch.float32, buckets.flat[dtype].device)
            # With fp32 accumulation the bucket buffer already is the fp32 gradient: alias it.
            flat_grad = buckets.flat[dtype] if grads_in_fp32 else flat_zeros(flat.numel(), torch.float32, flat.device)
            offset = 0
            for p in members:
                n = p.numel()
                # The gradient views have the parameter's strides (buckets.py), so the master copy too.
                master = torch.nn.Parameter(dense_view(flat[offset:offset + n], p))
                with torch.no_grad():
                    master.copy_(p.detach().float())
                master.grad = dense_view(flat_grad[offset:offset + n], p)
                master_of[p] = master
                self.model_params.append(p)
                self.master_params.append(master)
                offset += n
            self.flat[dtype], self.flat_grad[dtype] = flat, flat_grad
        for group in optimizer.param_groups:
            group["params"] = [master_of.get(p, p) for p in group["params"]]

    def load_grads(self, inv_scale: float) -> None:
        """Model-dtype gradients (still multiplied by the loss scale) → unscaled fp32 master gradients."""
        for dtype, flat_grad in self.flat_grad.items():
            src = self.buckets.flat[dtype]
            if flat_grad is not src:
                flat_grad.copy_(src)
            if inv_scale != 1.0:
                flat_grad.mul_(inv_scale)

    def grad_buffers(self) -> list[torch.Tensor]:
        return list(self.flat_grad.values())

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.model_params, self.master_params)
