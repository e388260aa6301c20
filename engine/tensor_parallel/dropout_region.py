"""Dropout inside the layers AutoTP shards draws from the model-parallel RNG stream.

[Note: AutoTP's parallel regions] Between a column-parallel projection's output and the input of its
row-parallel partner every tensor is partitioned: rank r holds heads (or hidden features) the other
ranks do not. Dropout there must draw a different mask on every tensor rank, as the dense model draws
independent masks per head; dropout on the replicated tensors outside must draw the same one (Megatron's
rule; `ParallelSelfAttention` forks the tracker around its attention for the same reason). An
unmodified model's forward (HF GPT-2's eager attention dropout, examples/gpt.py's SDPA `dropout_p`)
cannot be edited, so AutoTP marks the region with hooks on the layers it made: a column-parallel
layer's output switches the default generator to the tracked model-parallel stream, a row-parallel
layer's input (and the end of their owner's forward, even one that raised) switches it back, the
stream's new state kept in the tracker. Activation-checkpoint recomputes replay the tracker's states
(`engine.checkpointing`), so a recompute draws the forward's masks. Only in training, and only once
`model_parallel_cuda_manual_seed` made the stream (`initialize` does). Not covered: dropout on a
partitioned tensor that a model draws before its first column-parallel projection or after a
row-parallel one (no such tensor exists in the layouts AutoTP knows).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..activation_checkpointing.rng import MODEL_PARALLEL_RNG, _get_state, _set_state, get_cuda_rng_tracker


class _Region:
    """The default generator's state while the model-parallel stream is current, else None."""

    outer: torch.Tensor | None = None


_REGION = _Region()


def _enter(module: nn.Module, args, output) -> None:
    tracker = get_cuda_rng_tracker()
    if module.training and _REGION.outer is None and MODEL_PARALLEL_RNG in tracker.states:
        _REGION.outer = _get_state()
        _set_state(tracker.states[MODEL_PARALLEL_RNG])


def _leave(*_) -> None:
    if _REGION.outer is not None:
        get_cuda_rng_tracker().states[MODEL_PARALLEL_RNG] = _get_state()
        _set_state(_REGION.outer)
        _REGION.outer = None


def mark_parallel_region(owner: nn.Module, column: list[nn.Module], row: list[nn.Module]) -> None:
    """Hook `owner`'s sharded layers so that dropout between them draws from the model-parallel stream."""
    for layer in column:
        layer.register_forward_hook(_enter)
    for layer in row:
        layer.register_forward_pre_hook(_leave)
    owner.register_forward_hook(_leave, always_call=True)
