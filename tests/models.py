"""Small models and the single-process reference loop every parity test compares against."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from engine import activation_checkpointing


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


class ReuseNet(nn.Module):
    """The shapes of use a review found trained wrong: a head used only when `aux` is set (a branch
    not taken, an expert without tokens), a transposed weight (non-contiguous), a channels_last conv
    kernel, and one block applied twice — in two regions of activation checkpointing when
    `checkpointing` is "reentrant" or "non_reentrant", so with reentrant checkpointing its gradient
    arrives in two pieces."""

    def __init__(self, checkpointing: str | None = None):
        super().__init__()
        self.checkpointing = checkpointing
        self.inp = nn.Linear(13, 24)
        self.block = nn.Linear(24, 24)
        self.tw = nn.Parameter(torch.randn(24, 24).t() * 0.2)  # strides (1, 24)
        self.conv = nn.Conv2d(2, 2, 3, padding=1).to(memory_format=torch.channels_last)
        self.out = nn.Linear(24, 5)
        self.aux = nn.Linear(24, 5)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h))

    def forward(self, x: torch.Tensor, y: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            if self.checkpointing is None:
                h = self._block(h)
            elif self.checkpointing == "dstrain_reentrant":  # DeepSpeed's checkpointing.checkpoint API
                h = activation_checkpointing.checkpoint(self._block, h)
            else:
                h = torch.utils.checkpoint.checkpoint(self._block, h,
                                                      use_reentrant=self.checkpointing == "reentrant")
        h = h @ self.tw
        img = h.reshape(-1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
        h = h + self.conv(img).reshape(h.shape)
        out = self.out(h) + (self.aux(h) if aux else 0.0)
        return nn.functional.mse_loss(out, y)


def reference_accumulated(model: nn.Module, batches, world: int, gas: int, lr: float, aux_micro: int = 0,
                          clip: float = 0.0):
    """Single-process SGD (no momentum, no clipping: the update is linear in the gradient, so a wrong
    scale of any kind shows) on the global batch, split into the micro-batches the ranks see, with
    `aux` set in micro-step `aux_micro` only, clipped to `clip` if set. Returns the model and each step's
    gradient norm before clipping."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for x, y in batches:
        for k in range(gas):
            for r in range(world):
                xm, ym = list(micro_batches(x, y, r, world, gas))[k]
                (model(xm, ym, aux=k == aux_micro) / (gas * world)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, norms


class StackNet(nn.Module):
    """Three hidden layers in an `nn.ModuleList`: at ZeRO stage 3 each is its own gather group (a unit),
    so a prefetcher has groups to fetch ahead of use. Takes ReuseNet's call signature. `checkpointing`:
    each layer in a region of dstrain's reentrant checkpoint (each parameter in one region only)."""

    def __init__(self, d_in: int = 13, hidden: int = 24, d_out: int = 5, depth: int = 3,
                 checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        self.inp = nn.Linear(d_in, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            if self.checkpointing:
                h = activation_checkpointing.checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h)
            else:
                h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h), y)
