"""ZeRO stage 2: optimizer state and gradients partitioned across data-parallel ranks.

Memory per rank (Ψ parameters, N ranks, Adam): model weights, plus 4Ψ/N bytes of fp32 partition
gradient and 12Ψ/N of master weights and optimizer state; full gradients exist only while a bucket
(`reduce_bucket_size` elements, at most two buckets in flight) waits for its reduce-scatter.
Communication: Ψ reduce-scatter per micro-step, Ψ all-gather per step (2Ψ with no accumulation).

[Note: accumulation] As in DeepSpeed, stage 2 reduce-scatters on every micro-step and accumulates the
averaged gradients in the fp32 partition gradient; keeping full gradients across micro-steps instead
would bring back the Ψ of gradient memory this stage exists to remove. The price is (gas + 1)Ψ of
traffic per step instead of 2Ψ. For the same reason `engine.no_sync()` still reduces here (the result
is the same math).
[Note: bucket order] Buckets have a fixed composition (reverse registration order, as stage 0) and
bucket k is launched only after buckets 0..k-1, whatever order the hooks fire in, so every rank
issues the same collectives in the same order. After backward the buckets whose parameters got no
gradient are launched with zeros there, so no rank waits for a hook that never fires.
[Note: freeing] A parameter's gradient is packed into its bucket's rank-major send buffer in the
post-accumulate-grad hook, and `.grad` is dropped right there; the send buffer is dropped when its
reduce-scatter finished. Without `overlap_comm` each bucket is reduced synchronously in the hook.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .partition import RankMajorLayout, split_runs
from .stage1 import PartitionedZeroOptimizer


@dataclass
class _Bucket:
    index: int
    layout: RankMajorLayout
    targets: list[torch.Tensor]
    send_dtype: torch.dtype
    send: torch.Tensor | None = None
    pending: int = 0
    launched: bool = False


class ZeroStage2Optimizer(PartitionedZeroOptimizer):
    stage = 2

    def _init_gradients(self, bucket_numel: int, grad_accum_dtype: str | None) -> None:
        if grad_accum_dtype not in (None, "fp32"):
            raise ValueError(f"data_types.grad_accum_dtype: {grad_accum_dtype!r} is not supported with "
                             "zero_optimization.stage 2: gradient partitions always accumulate in fp32; "
                             'remove the key or use "fp32"')
        world = self.comm.world_size
        by_dtype: dict[torch.dtype, list] = {}
        for p in reversed(self.params):
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        for dtype, plist in by_dtype.items():
            sizes = [world * self.partition.fragments[p].padded for p in plist]
            for run in split_runs(plist, sizes, bucket_numel):
                params = [plist[i] for i in run]
                layout, targets = self._layout(params)
                bucket = _Bucket(len(self.buckets), layout, targets, self.comm_dtype or dtype)
                self.buckets.append(bucket)
                for p in params:
                    self._bucket_of[p] = bucket
        self._position = {p: i for b in self.buckets for i, p in enumerate(b.layout.params)}
        self._next_launch = 0
        self._reset_buckets()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _reset_buckets(self) -> None:
        self._next_launch = 0
        for b in self.buckets:
            b.send, b.pending, b.launched = None, len(b.layout.params), False

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        if bucket.launched:
            raise RuntimeError("ZeRO stage 2: a parameter received a second gradient in one backward pass after "
                               "its bucket was reduced; call engine.backward() once per micro-batch")
        if bucket.send is None:
            bucket.send = torch.zeros(bucket.layout.numel, dtype=bucket.send_dtype, device=param.device)
        bucket.layout.pack_one(self._position[param], param.grad, bucket.send, zero_padding=False)
        param.grad = None  # the full gradient is not kept (module note: freeing)
        bucket.pending -= 1
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending <= 0:
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.send is None:  # no parameter of this bucket got a gradient: contribute zeros
            bucket.send = torch.zeros(bucket.layout.numel, dtype=bucket.send_dtype)
        bucket.launched = True
        self._next_launch = bucket.index + 1
        self._start_reduce(bucket.layout, bucket.send, bucket.targets, accumulate=True)
        bucket.send = None  # the in-flight reduction holds the only reference
        if not self.overlap:
            self.inflight.drain()

    def before_backward(self, boundary: bool) -> None:
        for p in self.params:  # a user's zero_grad(set_to_none=False) may have left zero tensors behind
            p.grad = None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward, then every remaining bucket reduced and accumulated into the partition gradient."""
        super().backward(loss, retain_graph=retain_graph)
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        self.inflight.drain()
        self._reset_buckets()

    def after_backward(self) -> None:
        pass  # backward() already reduced this micro-step's gradients

    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank holds between steps: the fp32 partition, nothing else."""
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return held + self.partition.num_bytes()["master_grad"]
