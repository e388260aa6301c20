"""Self-attention and MLP with their heads / hidden features split across the tensor-parallel group
(Megatron's ParallelAttention / ParallelMLP): one all-reduce in forward and one in backward per block.

- `ParallelSelfAttention`: fused q|k|v `ColumnParallelLinear(parts=3)` gives each rank n_head/T whole
  heads; causal attention runs on those heads alone; `RowParallelLinear` sums the heads' projections.
- `ParallelMLP`: column-parallel up-projection, GELU on the local features, row-parallel down.
[Note: dropout] Attention-probability dropout acts on partitioned heads, so it draws from the tracked
model-parallel stream (`get_cuda_rng_tracker().fork()`: different on every rank, replayed by
activation-checkpoint recomputes). Dropout after the row-parallel all-reduce acts on a replicated
tensor and uses the default stream, the same on every tensor-parallel rank; `model_parallel_cuda_manual_seed`
seeds both.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..activation_checkpointing.rng import get_cuda_rng_tracker
from .group import tensor_parallel_comm
from .layers import ColumnParallelLinear, RowParallelLinear


def partitioned_dropout_context(active: bool):
    """The model-parallel RNG stream when a partitioned dropout will draw, otherwise nothing to switch."""
    return get_cuda_rng_tracker().fork() if active else contextlib.nullcontext()


class ParallelSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True, group=None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        comm = tensor_parallel_comm(group)
        if n_head % comm.world_size or d_model % n_head:
            raise ValueError(f"ParallelSelfAttention: n_head={n_head} must divide by the tensor-parallel size "
                             f"{comm.world_size} and d_model={d_model} by n_head")
        self.head_dim = d_model // n_head
        self.local_heads = n_head // comm.world_size
        self.dropout = dropout
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, bias=bias, parts=3, group=comm, device=device,
                                        dtype=dtype)
        self.proj = RowParallelLinear(d_model, d_model, bias=bias, input_is_parallel=True, group=comm,
                                      device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        with partitioned_dropout_context(p > 0):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, bias: bool = True, group=None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        comm = tensor_parallel_comm(group)
        self.fc = ColumnParallelLinear(d_model, d_hidden, bias=bias, group=comm, device=device, dtype=dtype)
        self.out = RowParallelLinear(d_hidden, d_model, bias=bias, input_is_parallel=True, group=comm,
                                     device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))
