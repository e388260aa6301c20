"""ZeRO stage 1: optimizer state (and fp32 master weights) partitioned across data-parallel ranks.

Memory per rank (Ψ parameters, N ranks, Adam): model weights, 12Ψ/N bytes of fp32 master weights,
exp_avg and exp_avg_sq, and 4Ψ/N of fp32 partition gradient (padding aside; partition.py). Full
gradients accumulate in `.grad` across accumulation micro-steps, as in plain PyTorch; the boundary
backward packs each one into its reduce-scatter bucket and drops it (partitioned.py's notes), so
after the boundary no full gradient remains.
Communication per step: gradients are reduce-scattered once, at the accumulation boundary, into the
rank's partition (Ψ), and the updated partitions are all-gathered back into the model (Ψ): the 2Ψ of
stage 0's all-reduce (ZeRO paper §7). Accumulation micro-steps communicate nothing. With one micro-
step per step this is stage 2, as in DeepSpeed, where both stages share one implementation.
"""
from __future__ import annotations

from .partitioned import PartitionedZeroOptimizer


class ZeroStage1Optimizer(PartitionedZeroOptimizer):
    stage = 1
    reduce_every_micro_step = False
