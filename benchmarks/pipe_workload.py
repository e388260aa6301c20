"""The pipeline benchmark's model and data, importable by dstrain's side and by DeepSpeed's venv
alike (torch only): a stack of Linear+GELU layers as a plain layer list, MSE loss."""
from __future__ import annotations

import os

import torch
import torch.nn as nn

# DSTRAIN_PIPE_MICRO (bench_pipeline's --micro-size) sets the rows per micro-batch for every process
# that imports this, dstrain's ranks and DeepSpeed's alike: larger micro-batches make compute dominate
# the per-message latency, which is how a bubble close to the schedule's formula can be seen here.
# DSTRAIN_PIPE_WIDTH (--width) sets the layers' width D: a stage computes rows·D² per layer and sends
# rows·D across a boundary, so a wider layer makes compute dominate the transfer's copying as well.
D = int(os.environ.get("DSTRAIN_PIPE_WIDTH", "512"))
LAYERS, MICRO = 16, int(os.environ.get("DSTRAIN_PIPE_MICRO", "16"))


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(LAYERS // 2):
        out += [nn.Linear(D, D), nn.GELU()]
    return out


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def micro_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)) for _ in range(n)]
