"""The selective policies: keep the outputs of some expensive ops, recompute the rest. They are
torch's selective activation checkpointing (`create_selective_checkpoint_contexts`), so they need the
non-reentrant checkpoint.

[Note: what is kept] `policy: "selective_all_matmuls"` (`save_expensive_ops`) saves the outputs of
every matrix product, attention kernel and collective (they cost FLOPs or bandwidth to redo) and
recomputes element-wise ops, norms, activations and dropout (memory bandwidth only). In a transformer
the matmul outputs are most of the activations, the MLP's up projection (4x the model width, and what
its activation then saves again) the largest: that rule keeps about 0.7 of them. `policy:
"selective"` (`save_expensive_but_widening`, the default selective rule) recomputes, besides, every
matrix product whose output is at least `WIDENING` times wider than its input (the up projection,
about 30% of a block's matmul FLOPs) and keeps the rest (the QKV projection, attention, the output
and down projections): about half the memory of the all-matmuls rule for a third more recompute
(docs/activation_checkpointing.md has the measured trade).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .probe import probing, report_kept

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


def _saved(ctx) -> CheckpointPolicy:
    if ctx.op_output is not None and probing():  # this runs on every kept op: no byte count unless asked
        report_kept(_bytes(ctx.op_output))
    return CheckpointPolicy.MUST_SAVE


def save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep every matmul, attention and collective output (`policy: "selective_all_matmuls"`)."""
    return _saved(ctx) if _is_saved(op) else CheckpointPolicy.PREFER_RECOMPUTE


WIDENING = 4  # an MLP's up projection; a QKV projection (3x) is kept
_MATMULS = frozenset(getattr(_aten, name) for name in ("mm", "addmm"))


def _widening(op, args) -> bool:
    """A 2-D matrix product (a linear layer) whose output is at least WIDENING times its input's width."""
    if getattr(op, "overloadpacket", op) not in _MATMULS:
        return False
    a, b = args[-2], args[-1]  # mm(a, b), addmm(bias, a, b)
    return b.shape[-1] >= WIDENING * a.shape[-1]


def save_expensive_but_widening(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """`policy: "selective"`: as `save_expensive_ops`, but widening matmuls are recomputed (module note)."""
    if _is_saved(op) and not _widening(op, args):
        return _saved(ctx)
    return CheckpointPolicy.PREFER_RECOMPUTE


selective_context = functools.partial(create_selective_checkpoint_contexts, save_expensive_but_widening)
"""`context_fn=` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: `policy: "selective"`."""
all_matmuls_context = functools.partial(create_selective_checkpoint_contexts, save_expensive_ops)
"""`policy: "selective_all_matmuls"`: every matmul output kept."""
CONTEXTS = {"selective": selective_context, "selective_all_matmuls": all_matmuls_context}
