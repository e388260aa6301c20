"""The gradient norm and the overflow decision of a tensor-parallel model, agreed over the world.

[Note: one norm under tensor parallelism] Each ZeRO optimizer agrees its norm² over its data group
only. Under tensor parallelism a sharded parameter's slices live on the T ranks of a model group,
and a replicated one (grads.py's note: identical on those T ranks) is held T times. So on tensor
rank r > 0 the optimizer leaves the replicated parameters out of its local square
(`counted_elsewhere`), and pipe3d's `norm_reduce` hook (engine/pipe/reduction.py) adds the squares
over the model-parallel group: sharded parameters counted fully, replicated ones once, in one
all-reduce of one float per step. Clipping then scales every rank by the same norm, and a NaN/Inf on
any rank (its square stays non-finite through both sums; a replicated parameter's Inf left out on
rank r > 0 is counted on rank 0, where it is the same Inf) makes every rank skip the same step, so
fp16's dynamic loss scale moves identically everywhere. ZeRO-3 takes the same route: its optimizer is
stage 2's with parameters partitioned too (over the data axis, the ranks of one tensor coordinate), so
the same `counted_elsewhere` and `norm_reduce` apply to its fragments unchanged.
"""
from __future__ import annotations

import torch.nn as nn

import schemas

from ..comm import Communicator
from ..pipe.reduction import WorldNorm
from .layers import is_partitioned


def counted_elsewhere(model: nn.Module, tensor_rank: int) -> list[nn.Parameter]:
    """The parameters this rank leaves out of its norm²: the replicated ones, except on tensor rank 0."""
    if tensor_rank == 0:
        return []
    return [p for p in model.parameters() if p.requires_grad and not is_partitioned(p)]


def agree_norm_over_tensor_parallel(zero_optimizer, model: nn.Module, groups) -> None:
    """Make `zero_optimizer` report and clip with the whole model's norm (module note)."""
    if getattr(zero_optimizer, "self_communicating", False):  # its local-gradient steps agree over data only
        raise schemas.ConfigError([f"optimizer.type: {type(zero_optimizer.optimizer).__name__} (a 1-bit optimizer) with "
                                   "tensor_parallel.autotp_size > 1 is not built yet in dstrain; use Adam, AdamW or SGD"])
    zero_optimizer.counted_elsewhere = counted_elsewhere(model, groups.coord.model)
    zero_optimizer.norm_reduce = WorldNorm(Communicator(groups.model_parallel_group))
