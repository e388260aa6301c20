"""Key/value projections with fewer key/value heads than tensor ranks (grouped-query attention at
T > num_key_value_heads, multi-query at 1).

[Note: fewer key/value heads than ranks] A column cut needs whole heads on each rank; with KV < T
there are not enough. Megatron keeps the key/value heads a rank's query heads read on that rank,
replicated over the T / KV ranks whose query heads share them. Replicating the projection's weight
would need its gradient summed over the ranks and counted once in the norm, and a checkpoint layout
for a replicated shard. Instead the weight is cut by its *input* features, as a row-parallel layer's
(a shard like any other: the norm counts it fully, a checkpoint records dim 1), and

| step | forward | backward |
|---|---|---|
| this rank's input features (`scatter_to_tensor_parallel_region`) | slice | all-gather of the input gradient |
| x_r W_rᵀ summed (`reduce_from_tensor_parallel_region`) | all-reduce: every rank the whole k | identity |
| + bias (replicated), then `copy_to_tensor_parallel_region` | identity | all-reduce |
| keep key/value head r·KV/T (head_dim wide) | slice | zeros elsewhere |

The output gradient on rank r is its query heads' share of the dense one; the all-reduce after the
bias sums the shares (zero outside each rank's kept head), so the bias's gradient and each weight
slice's, (Σ dk)ᵀ x_r, are the dense ones, and the input gradient gathered from the slices is the dense
key/value path's on every rank. Cost per projection: one all-reduce of the whole k in the forward, one
in the backward and one all-gather of the input gradient (hidden-size), where a column cut has one
input-gradient all-reduce. The owner's key/value head counts become 1 per rank
(`num_key_value_groups` = its query heads); AutoTP uses it for `k_proj`/`v_proj` when T divides by KV.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .group import tensor_parallel_comm
from .layers import _mark_conv1d_origin, _param, dense_features, dense_weight, mark_partitioned, shard, whole_parameters
from .mappings import (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       scatter_to_tensor_parallel_region)


class KeyValueHeadLinear(nn.Module):
    """`k = x Wᵀ + b` of `kv_heads` heads of `head_dim`, each rank returning the head its query heads read
    (module note)."""

    def __init__(self, dense: nn.Module, kv_heads: int, head_dim: int, group=None):
        super().__init__()
        self.comm = tensor_parallel_comm(group)
        world, rank = self.comm.world_size, self.comm.rank
        if world % kv_heads:
            raise ValueError(f"{kv_heads} key/value heads do not divide the {world} tensor-parallel ranks")
        self.out_features, self.in_features = dense_features(dense)
        if self.out_features != kv_heads * head_dim:
            raise ValueError(f"its {self.out_features} output features are not {kv_heads} heads of {head_dim}")
        self.head_dim, self.head = head_dim, rank * kv_heads // world
        with whole_parameters(dense):
            weight = dense_weight(dense)
            self.weight = mark_partitioned(_param(shard(weight, 1, rank, world), weight.requires_grad), 1, 1,
                                           weight.shape)
            _mark_conv1d_origin(self.weight, dense)
            bias = getattr(dense, "bias", None)
            self.bias = _param(bias, bias.requires_grad) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel_region(F.linear(scatter_to_tensor_parallel_region(x, self.comm), self.weight),
                                               self.comm)
        y = copy_to_tensor_parallel_region(y + self.bias if self.bias is not None else y, self.comm)
        return y[..., self.head * self.head_dim:(self.head + 1) * self.head_dim]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"keeps head {self.head} of head_dim {self.head_dim}")
