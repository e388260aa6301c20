"""`checkpoint` (reentrant, DeepSpeed's and Megatron's) and `non_reentrant_checkpoint`: torch's
`torch.utils.checkpoint` with what `configure()` adds — saved inputs moved to host memory or
partitioned across the tensor-parallel group, the tracked RNG streams replayed, a synchronised
boundary, and per-checkpoint timings.

[Note: packing the saved inputs] The reentrant checkpoint saves only its tensor inputs (its forward
runs without grad), with `save_for_backward`, so saved-tensor hooks around the call see exactly those:
`cpu_checkpointing` packs each to host memory (pinned, copied asynchronously on an accelerator; the
same code on CPU), `partition_activations` keeps this rank's 1/tp slice of each floating input and
all-gathers it back when backward unpacks it (every tensor-parallel rank unpacks the same inputs in
the same order: the ranks replicate the activations). Autograd restores the unpacked tensor's graph
metadata itself. The non-reentrant checkpoint saves nothing but holds its inputs for the recompute:
for `cpu_checkpointing` they go to host memory before the region and back inside it.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .probe import report_held
from .rng import get_cuda_rng_tracker
from .settings import STATE, model_parallel_info, synchronize_boundary


def _to_host(t: torch.Tensor):
    pinned = t.device.type != "cpu"
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return t.device, host


class _Partition:
    """This rank's slice of a flattened tensor, and how to make it whole again."""

    def __init__(self, t: torch.Tensor, group, rank: int, world: int, to_host: bool):
        self.shape, self.numel, self.device, self.group, self.world = t.shape, t.numel(), t.device, group, world
        per = -(-self.numel // world)
        flat = torch.nn.functional.pad(t.reshape(-1), (0, per * world - self.numel))
        self.slice = flat[rank * per:(rank + 1) * per].clone()
        self.on_host = to_host
        if to_host:
            _, self.slice = _to_host(self.slice)
        self.token = report_held(self.slice.numel() * self.slice.element_size())

    def whole(self) -> torch.Tensor:
        mine = self.slice.to(self.device, non_blocking=True)
        pieces = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(pieces, mine, group=self.group)
        return torch.cat(pieces)[:self.numel].view(self.shape)


class _Host:
    def __init__(self, t: torch.Tensor):
        self.device, self.host = _to_host(t)
        self.token = report_held(self.host.numel() * self.host.element_size())

    def whole(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=True)


def _packing_hooks():
    """Saved-tensor hooks for the reentrant checkpoint's inputs, or None when nothing is packed."""
    settings = STATE.settings
    group, rank, world = model_parallel_info()
    partition = settings.partition_activations and world > 1
    if not (partition or settings.cpu_checkpointing):
        return None

    def pack(t: torch.Tensor):
        if partition and t.is_floating_point() and t.numel() >= world:
            return _Partition(t, group, rank, world, settings.cpu_checkpointing)
        return _Host(t) if settings.cpu_checkpointing else t

    def unpack(packed):
        return packed.whole() if isinstance(packed, (_Partition, _Host)) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _instrumented(function):
    """`function`, with the tracked RNG streams replayed in its recompute and, with `profile`, each
    run timed; the first call is the forward, later ones are recomputes."""
    index, runs = STATE.calls, [0]
    STATE.calls += 1
    tracker = get_cuda_rng_tracker()
    forward_states = tracker.get_states()
    profile = STATE.settings.profile

    @functools.wraps(function)
    def run(*args, **kwargs):
        recompute, runs[0] = runs[0] > 0, runs[0] + 1
        outer_states = tracker.get_states()
        if recompute:
            tracker.set_states(forward_states)
        start = time.perf_counter() if profile else 0.0
        try:
            return function(*args, **kwargs)
        finally:
            if profile:
                synchronize_boundary()
                STATE.timings.append((index, "recompute" if recompute else "forward", time.perf_counter() - start))
            if recompute:
                tracker.set_states(outer_states)

    return run


def checkpoint(function, *args, **kwargs):
    """DeepSpeed's `deepspeed.checkpointing.checkpoint`: run `function(*args)` without keeping its
    activations and recompute them in backward (torch's reentrant checkpoint, RNG state preserved).
    Keyword arguments other than torch's own (`preserve_rng_state`) are an error, as in torch."""
    synchronize_boundary()
    hooks = _packing_hooks()
    run = _instrumented(function)
    if hooks is None:
        out = torch_checkpoint(run, *args, use_reentrant=True, **kwargs)
    else:
        with hooks:
            out = torch_checkpoint(run, *args, use_reentrant=True, **kwargs)
    synchronize_boundary()
    return out


_TORCH_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")  # torch's own, not the function's


def non_reentrant_checkpoint(function, *args, context_fn=None, **kwargs):
    """Torch's non-reentrant checkpoint (keyword arguments, inputs without gradients, nested regions,
    `context_fn` for a selective policy) with `cpu_checkpointing`, the RNG streams and `profile`.
    `partition_activations` with a tensor-parallel group needs the reentrant `checkpoint`."""
    settings = STATE.settings
    if settings.partition_activations and model_parallel_info()[2] > 1:
        raise NotImplementedError("activation_checkpointing.partition_activations with tensor parallelism works "
                                  "with engine.checkpointing.checkpoint (reentrant) only; use that for this region")
    synchronize_boundary()
    run = _instrumented(function)
    extra = {k: kwargs.pop(k) for k in _TORCH_OPTIONS if k in kwargs}
    if context_fn is not None:
        extra["context_fn"] = context_fn
    if settings.cpu_checkpointing:
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        host_args = [a.to("cpu", copy=True) if isinstance(a, torch.Tensor) else a for a in args]

        def on_device(*host):
            return run(*[h.to(d) if d is not None else h for h, d in zip(host, devices)], **kwargs)

        out = torch_checkpoint(on_device, *host_args, use_reentrant=False, **extra)
    else:
        out = torch_checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)
    synchronize_boundary()
    return out
