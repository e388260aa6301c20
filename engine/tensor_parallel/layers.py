"""Megatron-style parallel layers (arXiv:1909.08053 §3). Each states its collectives:

| layer | weight kept on a rank | forward | backward |
|---|---|---|---|
| `ColumnParallelLinear` | rows (output features) `[r·out/T, (r+1)·out/T)` | copy in; all-gather out if `gather_output` | all-reduce of the input grad |
| `RowParallelLinear` | columns (input features) `[r·in/T, (r+1)·in/T)` | split in unless `input_is_parallel`; all-reduce out | all-gather of the input grad if it split |
| `VocabParallelEmbedding` | rows (token ids) `[r·V/T, (r+1)·V/T)` | look up own ids, zeros elsewhere, all-reduce | — |

[Note: fused projections] `parts` > 1 (GPT-2's `c_attn`, a fused q|k|v) shards each of the `parts`
equal sections of the output separately, so rank r holds q_r|k_r|v_r and the local output still
splits into three: the heads of rank r in each. `parts` may list the sections' sizes instead where they
differ (Phi-3's `qkv_proj` under grouped-query attention: q is num_heads × head_dim wide, k and v
num_key_value_heads × head_dim each); each is split by T all the same, so rank r's output is
[q_r | k_r | v_r], which the model's own split by its (divided) head counts reads.
[Note: initialisation] Weights are drawn full size, the way the dense layer would draw them (same
generator, same order), and each rank keeps its slice: with every tensor-parallel rank on the same
default seed (Megatron's rule, engine.checkpointing's `model_parallel_cuda_manual_seed`), the sharded
layer holds exactly the dense layer's numbers. `from_dense` shards an existing `nn.Linear` or HF
`Conv1D` (whose weight is stored transposed, in × out) the same way; AutoTP uses it.
Each sharded parameter carries `tensor_parallel_dim`, `tensor_parallel_parts` and
`tensor_parallel_full_shape` (grads.py counts it in the norm fully; checkpoints record the full shape),
and a shard of a `Conv1D` weight `tensor_parallel_transposed`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .group import tensor_parallel_comm
from .mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, scatter_to_tensor_parallel_region)


def is_conv1d(module: nn.Module) -> bool:
    """HF's `Conv1D` (GPT-2's projections): a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def dense_weight(module: nn.Module) -> torch.Tensor:
    """(out, in) weight of an `nn.Linear` or of HF's `Conv1D` (stored in × out; forward x @ W + b)."""
    return module.weight.t() if is_conv1d(module) else module.weight


def dense_features(module: nn.Module) -> tuple[int, int]:
    """(out, in) of an `nn.Linear` or HF `Conv1D`, also one built in `engine.zero.Init` (its weight a
    placeholder of shape (0, *rest) between uses; `ds_shape` keeps the full one: zero/stage3_params.py)."""
    shape = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
    return (shape[1], shape[0]) if is_conv1d(module) else (shape[0], shape[1])


def _mark_conv1d_origin(weight: nn.Parameter, dense: nn.Module) -> None:
    """A shard of a `Conv1D` is kept (out, in) like any other; `tensor_parallel_transposed` says that the
    dense model holds its transpose, so a checkpoint records and reloads it in the dense orientation
    (engine/checkpoint/tensor_shards.py, note on HF Conv1D)."""
    if is_conv1d(dense):
        weight.tensor_parallel_transposed = True


def section_sizes(size: int, parts) -> list[int]:
    """The sizes along the split dimension of a fused projection's sections: `parts` equal ones (an int),
    or the sizes listed (Phi-3's q|k|v under grouped-query attention: q wider than k and v)."""
    if isinstance(parts, int):
        return [size // parts] * parts if size % parts == 0 else []
    return [int(s) for s in parts]


def shard(full: torch.Tensor, dim: int, rank: int, world: int, parts=1) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim`, section by section when it fuses `parts` sections
    (a count of equal ones, or their sizes: note on fused projections)."""
    size = full.shape[dim]
    sizes = section_sizes(size, parts)
    if sum(sizes) != size or any(s % world for s in sizes):
        what = f"{parts} section(s)" if isinstance(parts, int) else f"sections of {list(parts)}"
        raise ValueError(f"dimension {dim} of size {size} does not split into {what} × "
                         f"{world} tensor-parallel ranks")
    sections = full.split(sizes, dim=dim)
    return torch.cat([s.chunk(world, dim=dim)[rank] for s in sections], dim=dim).clone()


def join(shards: list[torch.Tensor], dim: int, parts=1) -> torch.Tensor:
    """The full tensor from every rank's shard in rank order: the inverse of `shard` (each shard holds
    its slice of each fused section, so the sections are joined one by one)."""
    world = len(shards)
    local = [s // world for s in section_sizes(shards[0].shape[dim] * world, parts)]
    sections = [s.split(local, dim=dim) for s in shards]
    return torch.cat([torch.cat([sec[i] for sec in sections], dim=dim) for i in range(len(local))], dim=dim)


def whole_parameters(dense: nn.Module):
    """A context in which `dense`'s parameters are whole. Inside `engine.zero.Init` the dense layer a
    parallel layer is cut from was partitioned over the data axis when its own `__init__` returned
    (zero/init.py's notes); it is gathered for the cut and released after, and the parallel layer's
    shards are then partitioned in turn. Elsewhere nothing to do."""
    from ..zero.init import GatheredParameters  # here: importing the layers need not load all of engine.zero
    return GatheredParameters(list(dense.parameters()))


def mark_partitioned(param: nn.Parameter, dim: int, parts, full_shape: torch.Size) -> nn.Parameter:
    param.tensor_parallel_dim = dim
    param.tensor_parallel_parts = parts if isinstance(parts, int) else tuple(parts)
    param.tensor_parallel_full_shape = tuple(full_shape)
    return param


def is_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_parallel_dim", None) is not None


def _param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=requires_grad)


class ColumnParallelLinear(nn.Module):
    """`y = x Aᵀ + b` with A's rows split: each rank computes its slice of the output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 parts=1, group=None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, _dense: nn.Module | None = None):
        super().__init__()
        if gather_output and parts > 1:
            raise ValueError("ColumnParallelLinear(gather_output=True, parts>1): the gathered output would interleave "
                             "the fused sections rank by rank; gather each section instead")
        self.comm = tensor_parallel_comm(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.parts = gather_output, parts
        dense = _dense if _dense is not None else nn.Linear(in_features, out_features, bias=bias, device=device,
                                                            dtype=dtype)
        world, rank = self.comm.world_size, self.comm.rank
        with whole_parameters(dense):
            weight = dense_weight(dense)
            self.weight = mark_partitioned(_param(shard(weight, 0, rank, world, parts), weight.requires_grad),
                                           0, parts, weight.shape)
            _mark_conv1d_origin(self.weight, dense)
            self.bias = None
            if getattr(dense, "bias", None) is not None:
                self.bias = mark_partitioned(_param(shard(dense.bias, 0, rank, world, parts),
                                                    dense.bias.requires_grad), 0, parts, dense.bias.shape)

    @classmethod
    def from_dense(cls, module: nn.Module, parts=1, gather_output: bool = False, group=None):
        out_features, in_features = dense_features(module)
        return cls(in_features, out_features, gather_output=gather_output, parts=parts, group=group, _dense=module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel_region(x, self.comm), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), parts={self.parts}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """`y = x Aᵀ + b` with A's columns split: each rank multiplies its slice of the input features, the
    partial products are summed by one all-reduce, and the (replicated) bias is added once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 group=None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 _dense: nn.Module | None = None):
        super().__init__()
        self.comm = tensor_parallel_comm(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        dense = _dense if _dense is not None else nn.Linear(in_features, out_features, bias=bias, device=device,
                                                            dtype=dtype)
        with whole_parameters(dense):
            weight = dense_weight(dense)
            self.weight = mark_partitioned(_param(shard(weight, 1, self.comm.rank, self.comm.world_size),
                                                  weight.requires_grad), 1, 1, weight.shape)
            _mark_conv1d_origin(self.weight, dense)
            bias_t = getattr(dense, "bias", None)
            self.bias = _param(bias_t, bias_t.requires_grad) if bias_t is not None else None

    @classmethod
    def from_dense(cls, module: nn.Module, input_is_parallel: bool = True, group=None):
        out_features, in_features = dense_features(module)
        return cls(in_features, out_features, input_is_parallel=input_is_parallel, group=group, _dense=module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.comm)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by token id: a rank looks up the ids it holds and contributes zeros for
    the rest; one all-reduce assembles the full embedding on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 _dense: nn.Embedding | None = None):
        super().__init__()
        self.comm = tensor_parallel_comm(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        dense = _dense if _dense is not None else nn.Embedding(num_embeddings, embedding_dim, device=device,
                                                               dtype=dtype)
        if dense.padding_idx is not None or dense.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx and max_norm are not supported; use a plain table")
        with whole_parameters(dense):
            self.weight = mark_partitioned(_param(shard(dense.weight, 0, self.comm.rank, self.comm.world_size),
                                                  dense.weight.requires_grad), 0, 1, dense.weight.shape)
        self.vocab_start = self.comm.rank * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    @classmethod
    def from_dense(cls, module: nn.Embedding, group=None):
        return cls(module.num_embeddings, module.embedding_dim, group=group, _dense=module)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ids [{self.vocab_start}, {self.vocab_end})"
