"""Replicated parameters used inside a parallel region: their gradient is a sum over tensor ranks.

[Note: partial gradients] grads.py's rule — a replicated parameter's gradient agrees on every tensor
rank by construction — holds for parameters outside the regions between a column-parallel layer and
its row-parallel partner. A replicated parameter used inside one sees only this rank's heads: Qwen3's
and Gemma 3's `q_norm` / `k_norm` (an RMSNorm over head_dim, applied to each head). Each rank's
gradient is then its heads' share, and stepping it as it was trained every rank's copy differently:
after 4 SGD steps Qwen3's q_norm weights were 2e-3 apart between the two tensor ranks, and the
gradient was off by its own size. The dense gradient is the sum of the shares.

Which parameters those are cannot be told from the module tree (examples/gpt.py's block holds its
layer norms beside the projections, outside the regions). So it is seen in the forward: a region is
open from a column-parallel layer's output to its row-parallel partner's input (or the end of their
owner's forward). A child of the owner holding trainable parameters, other than the parallel layers,
that runs while a region is open has its parameters' gradients summed over the tensor group by a
gradient hook, before they are accumulated (so the ZeRO and data-parallel paths see the dense
gradient), one small all-reduce per such parameter and backward. A recompute runs the same hooks.
A parameter the owner holds directly has no forward of its own to see it by: own_params.py finds
where it is used in the autograd graph of the owner's first forward.
A child running inside a region with a parameter as wide as a column-parallel layer's whole output
(or one fused section of it) works on every head at once — OLMo2's q_norm over the whole query
projection, Cohere's per-head norm weights (heads × head_dim) — and cannot run on one rank's heads:
it would fail with a shape error naming no layer. Its first forward raises instead, naming it. So does
one holding a parameter per head that together are that wide (StableLM's q_layernorm: a ModuleList of
num_heads LayerNorms over head_dim, zipped with the heads it is given): on one rank's heads it ran
without error, each rank's heads normalised by the first heads' norms, silently wrong.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .collective_ledger import note
from .layers import section_sizes


class _Open:
    """Whether a parallel region is open now (the forward runs in one thread). dropout_region.py's
    `mark_parallel_region` opens and closes it with the same hooks that switch the dropout stream."""

    region = False


_OPEN = _Open()


def region_is_open() -> bool:
    return _OPEN.region


def open_region() -> None:
    _OPEN.region = True


def close_region() -> None:
    _OPEN.region = False


def _summing_hook(comm):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # autograd may hold the incoming tensor elsewhere
        note("all_reduce", comm, grad, torch.distributed.ReduceOp.SUM)  # collective_ledger.py
        comm.all_reduce(grad)
        return grad
    return hook


def sum_gradient_over(p: torch.Tensor, comm) -> None:
    """Sum `p`'s gradient over the tensor group `comm` in every backward from now on (once per parameter)."""
    if p.requires_grad and not getattr(p, "_tensor_parallel_summed", False):
        p._tensor_parallel_summed = True
        p.register_hook(_summing_hook(comm))


def _refuse_whole_width(module: nn.Module, widths: set[int]) -> None:
    per_leaf: dict[str, list[str]] = {}  # `weight` -> every `norms.<i>.weight` (module note: one per head)
    sizes: dict[str, int] = {}
    for name, p in module.named_parameters():
        leaf = name.rpartition(".")[2]
        per_leaf.setdefault(leaf, []).append(name)
        sizes[leaf] = sizes.get(leaf, 0) + p.numel()
        if p.numel() in widths:
            _whole_width_error(module, f"{name} {tuple(p.shape)} runs")
    for leaf, names in per_leaf.items():
        if len(names) > 1 and sizes[leaf] in widths:
            _whole_width_error(module, f"{names[0]} ... {names[-1]} ({len(names)}, one per head) run")


def _whole_width_error(module: nn.Module, what: str):  # `what`: the parameter(s) and the verb
    raise ValueError(f"tensor parallelism: {type(module).__name__}'s {what} between a column-parallel layer "
                     "and its row-parallel partner, spanning every head, so it cannot run on one rank's heads; leave "
                     "tensor_parallel.autotp_size at 1 for this model, or shard it with engine.tensor_parallel's layers")


def _watch(child: nn.Module, comm, widths: set[int]) -> None:
    """Sum the gradients of `child`'s parameters over `comm` once it is seen running inside a region;
    the hook then removes itself (the parameters' shapes and hooks are set for good: nothing per forward)."""
    def pre_hook(module, _args) -> None:
        if not _OPEN.region:
            return
        _refuse_whole_width(module, widths)
        for p in module.parameters():
            sum_gradient_over(p, comm)
        handle.remove()
    handle = child.register_forward_pre_hook(pre_hook)


def column_widths(column: list[nn.Module]) -> set[int]:
    """A column layer's whole output and one fused section of it (module note). A key/value head layer
    (kv_heads.py) hands each rank one whole head: what runs on it meets what it would in the dense model."""
    widths = set()
    for layer in column:
        if getattr(layer, "head_dim", None) is not None:  # a KeyValueHeadLinear
            continue
        widths |= {layer.out_features, *section_sizes(layer.out_features, layer.weight.tensor_parallel_parts)}
    return widths


def watch_region_children(owner: nn.Module, column: list[nn.Module], row: list[nn.Module],
                          widths: set[int]) -> None:
    """Watch `owner`'s children other than its parallel layers (module note)."""
    parallel = set(column) | set(row)
    for child in owner.children():
        inner = set(child.modules())
        if child not in parallel and not inner & parallel and any(p.requires_grad for p in child.parameters()):
            _watch(child, column[0].comm, widths)
