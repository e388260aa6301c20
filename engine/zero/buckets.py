"""Flat gradient storage split into buckets that are reduced in one fixed order.

[Note: gradient views] Every trainable parameter's `.grad` is a view into one flat buffer per dtype,
so autograd accumulates micro-batch gradients in place (AccumulateGrad adds into an existing grad)
and a bucket is reduced with one collective and no copy (DDP's `gradient_as_bucket_view`).
[Note: launch order] Collectives must be issued in the same order on every rank. Buckets are laid
out in reverse registration order (roughly the order backward produces gradients), and bucket k is
only launched after buckets 0..k-1, whatever order the hooks fire in. After backward, `flush()`
launches whatever is left (unused parameters contribute zeros), so no rank waits on a hook that
never fires. A bucket whose parameter got its gradient in two pieces is deferred to the end of
backward (arrivals.py's note).
[Note: strides] A view has its parameter's strides (`dense_view`), so a transposed or channels_last
parameter and its gradient agree element by element in memory, as fused optimizers assume.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from offload.huge_pages import flat_zeros

from .arrivals import ArrivalLog, dense_view


@dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor  # a slice of the flat buffer of its dtype
    pending: int = 0
    work: object = None
    finish: Callable[[], None] | None = None
    launched: bool = False
    deferred: bool = False  # waits for the end of backward (arrivals.py's note)
    ready: set = field(default_factory=set)


# reduce_fn(bucket) starts the bucket's collective and returns (work or None, finish callback or None).
ReduceFn = Callable[[Bucket], tuple[object, Callable[[], None] | None]]


class GradientBuckets:
    """Owns `.grad` of `params`: flat per-dtype storage, bucketed, reduced by `reduce_fn`."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_numel: int, reduce_fn: ReduceFn,
                 overlap: bool, grad_dtype: torch.dtype | None = None, arrivals: ArrivalLog | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.arrivals = arrivals or ArrivalLog()
        self.reduce_fn = reduce_fn
        self.overlap = overlap
        self.armed = False
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        self.members: dict[torch.dtype, list[torch.nn.Parameter]] = {}  # flat layout, in order
        self.views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        self._next_launch = 0
        self._build(max(1, int(bucket_numel)), grad_dtype)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _build(self, bucket_numel: int, grad_dtype: torch.dtype | None) -> None:
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for p in reversed(self.params):
            by_dtype[grad_dtype or p.dtype].append(p)
        for dtype, plist in by_dtype.items():
            device = plist[0].device
            flat = flat_zeros(sum(p.numel() for p in plist), dtype, device)  # huge pages on a host
            self.flat[dtype] = flat
            self.members[dtype] = plist
            offset, start, members = 0, 0, []
            for p in plist:
                if members and offset + p.numel() - start > bucket_numel:
                    self._add_bucket(dtype, members, flat[start:offset])
                    start, members = offset, []
                self.views[p] = dense_view(flat[offset:offset + p.numel()], p)
                members.append(p)
                offset += p.numel()
            if members:
                self._add_bucket(dtype, members, flat[start:offset])
        self.attach()

    def _add_bucket(self, dtype, members, buffer) -> None:
        bucket = Bucket(len(self.buckets), dtype, list(members), buffer)
        self.buckets.append(bucket)
        for p in members:
            self._bucket_of[p] = bucket

    def attach(self) -> None:
        """(Re)point every `.grad` at its view: a user's `zero_grad(set_to_none=True)` may have dropped it.
        A view of another dtype than its parameter (e.g. fp32 accumulation of bf16 gradients) cannot be
        a `.grad`; those are accumulated by the hook instead."""
        for p, view in self.views.items():
            if view.dtype != p.dtype:
                continue
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def arm(self) -> None:
        """The coming backward ends an accumulation window: its gradients get reduced."""
        self.attach()
        self.armed = True
        self._next_launch = 0
        for b in self.buckets:
            b.pending, b.launched, b.work, b.finish = len(b.params), False, None, None
            b.ready.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        view = self.views[param]
        if view.dtype != param.dtype:
            view.add_(param.grad)
            param.grad = None
        repeat = self.arrivals.arrive(param, reducing=self.armed)
        if not self.armed:
            return
        bucket = self._bucket_of[param]
        if repeat:  # the gradient came in pieces (arrivals.py's note); the second one is in the view now
            if bucket.launched:
                raise self.arrivals.late_gradient(0, param)
            bucket.deferred = True
            return
        bucket.ready.add(param)
        bucket.pending -= 1
        if self.overlap and not self.arrivals.discovering:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending or bucket.deferred:
                break
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work, bucket.finish = self.reduce_fn(bucket)
        bucket.launched = True
        self._next_launch = bucket.index + 1

    def flush_and_wait(self) -> None:
        """Launch every bucket not yet launched (in order), then wait for all of them."""
        if not self.armed:
            return
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.finish is not None:
                bucket.finish()
        self.armed = False
        self.arrivals.end_pass()

    def zero(self) -> None:
        for flat in self.flat.values():
            flat.zero_()
        self.attach()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
