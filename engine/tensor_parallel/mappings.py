"""The four collectives of a Megatron model-parallel region, one autograd function each
(Megatron-Core's `mappings.py`; arXiv:1909.08053 §3, the f and g operators):

| function | forward | backward |
|---|---|---|
| `copy_to_tensor_parallel_region` | identity | all-reduce |
| `reduce_from_tensor_parallel_region` | all-reduce | identity |
| `scatter_to_tensor_parallel_region` | keep this rank's slice of the last dim | all-gather the last dim |
| `gather_from_tensor_parallel_region` | all-gather the last dim | keep this rank's slice |

The last dimension is the one split (hidden features, heads × head_dim, vocabulary); it must divide
by the group size. Every collective goes through the group's `Communicator`, so its bytes are counted
and its tensors' device is checked; buffers are made on the input's own device.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from .collective_ledger import note


def split_last_dim(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension."""
    if x.shape[-1] % comm.world_size:
        raise ValueError(f"last dimension {x.shape[-1]} does not divide by the tensor-parallel size {comm.world_size}")
    return x.chunk(comm.world_size, dim=-1)[comm.rank].contiguous()


def gather_last_dim(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension (rank order)."""
    if comm.world_size == 1:
        return x
    x = x.contiguous()
    note("all_gather", comm, x)  # collective_ledger.py
    # all_gather concatenates along dim 0, so gather (world, *shape) and move the rank axis last.
    out = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x)
    return torch.cat(out.unbind(0), dim=-1)


def all_reduce_sum(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    x = x.contiguous().clone()
    note("all_reduce", comm, x, torch.distributed.ReduceOp.SUM)
    comm.all_reduce(x)
    return x


class _CopyToRegion(torch.autograd.Function):
    delivers_gradients_once = True  # a collective, no backward of its own (engine/zero/arrivals.py)

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    delivers_gradients_once = True

    @staticmethod
    def forward(ctx, x, comm):
        return all_reduce_sum(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    delivers_gradients_once = True

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return split_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.comm), None


class _GatherFromRegion(torch.autograd.Function):
    delivers_gradients_once = True

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return gather_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.comm), None


def copy_to_tensor_parallel_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _CopyToRegion.apply(x, comm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, comm)


def scatter_to_tensor_parallel_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _ScatterToRegion.apply(x, comm)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _GatherFromRegion.apply(x, comm)
