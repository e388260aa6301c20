"""Gradients under tensor parallelism.

[Note: replicated gradients agree by construction] A parameter replicated over the group (layer
norms, a row-parallel layer's bias, embeddings AutoTP leaves whole) sees the same input and the same
output gradient on every rank: inputs to the partitioned region pass `copy_to_tensor_parallel_region`,
whose backward all-reduces, and outputs leave through an all-reduce. So its gradient is the same on
every rank with no extra collective (tests/test_tensor_parallel.py checks it bit for bit), and the
data-parallel reduction keeps it so. Not so for one used *inside* a region (Qwen3's per-head q_norm):
its gradient is this rank's heads' share, summed over the group by region_params.py.
[Note: the global norm] ‖g‖² = Σ over partitioned parameters of their slices' squares, summed over the
group, + Σ over replicated parameters counted once. `tensor_parallel_grad_norm_squared` returns this
rank's share of that sum so the caller adds the shares with one all-reduce over the whole
model-parallel group (tensor × pipeline): a replicated parameter contributes only on tensor rank 0.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .layers import is_partitioned


def tensor_parallel_grad_norm_squared(params: Iterable[torch.Tensor], tensor_rank: int,
                                      device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (module note), as a float32 scalar on `device`."""
    share = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None or (not is_partitioned(p) and tensor_rank != 0):
            continue
        share += p.grad.detach().float().pow(2).sum()
    return share


def tensor_parallel_grad_norm(params: Iterable[torch.Tensor], comm) -> torch.Tensor:
    """The global gradient norm over a tensor-parallel group's `comm` (its ranks hold one model)."""
    share = tensor_parallel_grad_norm_squared(params, comm.rank, comm.device)
    comm.all_reduce(share)
    return share.sqrt()
