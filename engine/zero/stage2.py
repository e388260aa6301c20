"""ZeRO stage 2: optimizer state and gradients partitioned across data-parallel ranks.

Memory per rank (Ψ parameters, N ranks, Adam): model weights, plus 4Ψ/N bytes of fp32 partition
gradient and 12Ψ/N of master weights and optimizer state; full gradients exist only while a bucket
(`reduce_bucket_size` elements, at most REDUCE_DEPTH (4) buckets in flight) waits for its reduce-scatter
(partitioned.py's notes).
Communication: Ψ reduce-scatter per micro-step, Ψ all-gather per step (2Ψ with no accumulation).

[Note: accumulation] As in DeepSpeed, stage 2 reduce-scatters on every micro-step and accumulates the
averaged gradients in the fp32 partition gradient; keeping full gradients across micro-steps instead
(stage 1) would bring back the Ψ of gradient memory this stage exists to remove. The price is
(gas + 1)Ψ of traffic per step instead of 2Ψ. For the same reason `engine.no_sync()` still reduces
here (the result is the same math).
"""
from __future__ import annotations

from .partitioned import PartitionedZeroOptimizer


class ZeroStage2Optimizer(PartitionedZeroOptimizer):
    stage = 2
    reduce_every_micro_step = True
