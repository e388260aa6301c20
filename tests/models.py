"""Small models and the single-process reference loop every parity test compares against."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class OddMLP(nn.Module):
    """Layers with sizes that divide by nothing in particular, a 1-element parameter, and a frozen one."""

    def __init__(self, d_in: int = 13, hidden: int = 37, d_out: int = 5):
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, d_out)
        self.scale = nn.Parameter(torch.ones(1))
        self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x)) + self.frozen.sum() * 0.0
        h = torch.tanh(self.l2(h))
        out = self.l3(h) * self.scale
        return nn.functional.mse_loss(out, y)


def make_batches(steps: int, global_batch: int, d_in: int = 13, d_out: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, d_in, generator=g), torch.randn(global_batch, d_out, generator=g))
            for _ in range(steps)]


def reference_train(model: nn.Module, batches, make_optimizer, clip: float = 0.0, make_scheduler=None):
    """Plain single-process training on the global batch: the ground truth for every strategy."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model.parameters())
    sched = make_scheduler(opt) if make_scheduler else None
    losses, lrs = [], []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return model, losses, lrs


def micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world: int, gas: int):
    """This rank's `gas` micro-batches of a global batch laid out as [micro-step][rank][sample]."""
    micro = x.shape[0] // (world * gas)
    for k in range(gas):
        start = (k * world + rank) * micro
        yield x[start:start + micro], y[start:start + micro]
