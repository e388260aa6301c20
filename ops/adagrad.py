"""Adagrad as DeepSpeed's CPU Adagrad computes it (s ← s + g², x ← x − lr·g/(√s + ε), L2 decay added to
g): that is torch.optim.Adagrad's update with lr_decay 0, so torch's kernels (fused on CPU) run it.

torch.optim.Adagrad makes its state in the constructor, over the parameters it was given; ZeRO replaces
those by flat partitions before the first step (engine/zero/partition.py), which needs a fresh
optimizer. This subclass only defers that state to the first step, with torch's own initial values.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype


class Adagrad(torch.optim.Adagrad):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.state.clear()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    fused = bool(group["fused"])
                    self.state[p]["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused),
                                                        device=p.device if fused else torch.device("cpu"))
                    self.state[p]["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                                           memory_format=torch.preserve_format)
        return super().step(closure)
