"""Per-tensor reductions over flat buffers that hold pieces of many tensors (ZeRO's partitions).

A `FlatSegments` says, for every element of one flat buffer, which parameter tensor it belongs to (a
global index shared by all ranks). Per-tensor sums of squares then take `index_add_`s over each flat, and
the partial sums of every flat of every rank are summed in one reduction of one vector, so a per-tensor
rule (LAMB's trust ratio) sees exactly the norms of the whole tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class FlatSegments:
    ids: torch.Tensor  # int64, one per flat element: the index of its tensor in [0, count)
    count: int  # tensors in the whole (global) index space


@dataclass
class SegmentedReduction:
    """Where a per-tensor optimizer finds its flats' segments and the one cross-rank sum it may call."""

    segments: dict  # flat tensor -> FlatSegments
    count: int
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]  # sums a vector over ranks, returns the result

