"""`checkpoint` (reentrant, DeepSpeed's and Megatron's) and `non_reentrant_checkpoint`: torch's
`torch.utils.checkpoint` with what `configure()` adds — saved inputs moved to host memory or
partitioned across the tensor-parallel group, the tracked RNG streams replayed, a synchronised
boundary, and per-checkpoint timings.

[Note: packing the saved inputs] The reentrant checkpoint saves only its tensor inputs (its forward
runs without grad), with `save_for_backward`, so saved-tensor hooks around the call see exactly those:
`cpu_checkpointing` packs each to host memory (pinned, copied asynchronously on an accelerator; the
same code on CPU), `partition_activations` keeps this rank's 1/tp slice of each floating input and
all-gathers it back when backward unpacks it (every tensor-parallel rank unpacks the same inputs in
the same order: the ranks replicate the activations; `partition.py`). Autograd restores the unpacked
tensor's graph metadata itself. The non-reentrant checkpoint saves nothing but holds its inputs for
the recompute, so the region is handed what should be held instead: this rank's slice (made whole
inside the region, `partition.py`) or a host copy (moved back inside it). Under `torch.no_grad()`
(evaluation) no backward will come: the non-reentrant region is handed its inputs as they are (not
split, moved or copied into `contiguous_memory_optimization`'s slots); the reentrant one saves
nothing then, so its hooks pack nothing.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import time

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .contiguous import SLOTS
from .partition import Gather, Layout, Partition, Scatter, ToHost, to_host
from .probe import report_held
from .recompute_probe import recomputing
from .region_params import recording
from .rng import device_rng_states, get_cuda_rng_tracker, set_device_rng_states
from .settings import STATE, model_parallel_info, synchronize_boundary


class _Host:
    """A reentrant checkpoint's saved input in host memory (cpu_checkpointing without partitioning)."""

    def __init__(self, t: torch.Tensor):
        self.device, self.host = t.device, to_host(t)
        self.token = report_held(self.host.numel() * self.host.element_size())

    def whole(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=True)


def _partitioning():
    """(group, rank, world) when checkpoint inputs are partitioned, else None. With
    contiguous_memory_optimization a group of one is partitioned too (the whole tensor is the slice),
    so its buffers are used as in DeepSpeed."""
    settings = STATE.settings
    group, rank, world = model_parallel_info()
    if settings.partition_activations and (world > 1 or settings.contiguous_checkpointing):
        return group, rank, world
    return None


def _partitions(t, group_info) -> bool:
    return group_info is not None and t.is_floating_point() and t.numel() >= group_info[2]


def _packing_hooks():
    """Saved-tensor hooks for the reentrant checkpoint's inputs, or None when nothing is packed."""
    settings = STATE.settings
    group_info = _partitioning()
    if not (group_info or settings.cpu_checkpointing):
        return None
    positions = itertools.count()  # the input position of each partitioned tensor (contiguous.py)

    def pack(t: torch.Tensor):
        if _partitions(t, group_info):
            return Partition(t, Layout(t, *group_info), next(positions), settings)
        return _Host(t) if settings.cpu_checkpointing else t

    def unpack(packed):
        return packed.whole() if isinstance(packed, (Partition, _Host)) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _instrumented(function, devices=()):
    """`function`, with the tracked RNG streams (and the default generators of the accelerator
    `devices`) replayed in its recompute and, with `profile`, each run timed; the first call is the
    forward, later ones are recomputes."""
    index, runs = STATE.calls, [0]
    STATE.calls += 1
    tracker = get_cuda_rng_tracker()
    forward_states, forward_device_states = tracker.get_states(), device_rng_states(devices)
    profile = STATE.settings.profile

    @functools.wraps(function)
    def run(*args, **kwargs):
        recompute, runs[0] = runs[0] > 0, runs[0] + 1
        outer_states = tracker.get_states()
        if recompute:
            tracker.set_states(forward_states)
            outer_device_states = device_rng_states(devices)
            set_device_rng_states(devices, forward_device_states)
            SLOTS.release()  # backward has begun: the next forward fills fresh buffers (contiguous.py)
        start = time.perf_counter() if profile else 0.0
        try:
            with recomputing() if recompute else contextlib.nullcontext():
                return function(*args, **kwargs)
        finally:
            if profile:
                synchronize_boundary()
                STATE.timings.append((index, "recompute" if recompute else "forward", time.perf_counter() - start))
            if recompute:
                tracker.set_states(outer_states)
                set_device_rng_states(devices, outer_device_states)

    return run


def checkpoint(function, *args, **kwargs):
    """DeepSpeed's `deepspeed.checkpointing.checkpoint`: run `function(*args)` without keeping its
    activations and recompute them in backward (torch's reentrant checkpoint, RNG state preserved).
    Keyword arguments other than torch's own (`preserve_rng_state`) are an error, as in torch."""
    synchronize_boundary()
    hooks = _packing_hooks()
    run = _instrumented(function)
    # the parameters the region uses, for ZeRO's first backward (region_params.py's note)
    with recording(args) as record, (hooks if hooks is not None else contextlib.nullcontext()):
        out = torch_checkpoint(run, *args, use_reentrant=True, **kwargs)
    record.attach(out)
    synchronize_boundary()
    return out


_TORCH_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")  # torch's own, not the function's


def _held_inputs(args):
    """What the non-reentrant checkpoint holds for each argument, and how the region rebuilds it:
    this rank's slice (partition.py), a host copy (cpu_checkpointing), or the argument itself."""
    settings, group_info = STATE.settings, _partitioning()
    if not torch.is_grad_enabled():  # no backward to hold anything for (the module note)
        return list(args), [None] * len(args)
    held, rebuild, positions = [], [], itertools.count()
    for a in args:
        if isinstance(a, torch.Tensor) and _partitions(a, group_info):
            layout = Layout(a, *group_info)
            held.append(Scatter.apply(a, layout, next(positions), settings))
            rebuild.append(lambda h, layout=layout: Gather.apply(h, layout))
        elif isinstance(a, torch.Tensor) and settings.cpu_checkpointing:
            held.append(ToHost.apply(a))  # pinned from an accelerator; the gradient goes back to a's device
            rebuild.append(lambda h, device=a.device: h.to(device, non_blocking=True))
        else:
            held.append(a)
            rebuild.append(None)
    return held, rebuild


def non_reentrant_checkpoint(function, *args, context_fn=None, **kwargs):
    """Torch's non-reentrant checkpoint (keyword arguments, inputs without gradients, nested regions,
    `context_fn` for a selective policy) with `partition_activations` (its tensor arguments; keyword
    arguments are held whole), `cpu_checkpointing`, the RNG streams and `profile`."""
    synchronize_boundary()
    extra = {k: kwargs.pop(k) for k in _TORCH_OPTIONS if k in kwargs}
    if context_fn is not None:
        extra["context_fn"] = context_fn
    held, rebuild = _held_inputs(args)
    # [Note: replaying an accelerator's generator] torch's checkpoint saves and replays the RNG state
    # of its inputs' devices only; handed host copies (cpu_checkpointing), it would replay the CPU's
    # alone and a recompute's dropout on the accelerator would draw new masks, so the region does it
    moved = {a.device for a, h in zip(args, held)
             if isinstance(a, torch.Tensor) and a.device.type != "cpu" and h.device != a.device}
    run = _instrumented(function, sorted(moved, key=str))

    def region(*inputs):
        return run(*[r(h) if r is not None else h for h, r in zip(inputs, rebuild)], **kwargs)

    out = torch_checkpoint(region, *held, use_reentrant=False, **extra)
    synchronize_boundary()
    return out
