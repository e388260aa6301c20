"""The selective policy: keep the outputs of the expensive ops, recompute the cheap rest.

[Note: what is kept] Outputs of matrix products, attention kernels and collectives are saved (they
cost FLOPs or bandwidth to redo); element-wise ops, norms, activations and dropout are recomputed
(they cost memory bandwidth only). It is torch's selective activation checkpointing
(`create_selective_checkpoint_contexts`), so it needs the non-reentrant checkpoint.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .probe import report_kept

_aten = torch.ops.aten
_SAVED_ATEN = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
SAVED_OPS = frozenset(getattr(_aten, name) for name in _SAVED_ATEN if hasattr(_aten, name))


def _is_saved(op) -> bool:
    packet = getattr(op, "overloadpacket", op)
    # functional collectives (all_reduce, all_gather_into_tensor, ...) live in _c10d_functional
    return packet in SAVED_OPS or getattr(op, "namespace", "") == "_c10d_functional"


def _bytes(out) -> int:
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


def save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if not _is_saved(op):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if ctx.op_output is not None:
        report_kept(_bytes(ctx.op_output))
    return CheckpointPolicy.MUST_SAVE


selective_context = functools.partial(create_selective_checkpoint_contexts, save_expensive_ops)
"""`context_fn=` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`."""
