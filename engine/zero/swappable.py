"""Which optimizers the NVMe tier's swapped step can run (engine/zero/nvme_tier.py, docs/optimizers.md).

`SwappedPartition` (offload/swapped_partition.py) steps one sub-group of a flat partition at a time with
a copy of the configured optimizer over a placeholder parameter. That is the optimizer's own math only
when its update is elementwise (each element from its own gradient, state and per-step scalars) and
its state is made lazily at the first step (the placeholder's state is swapped in and out around it).
- Adam, AdamW, SGD, dstrain's Adagrad (torch's, state deferred to the first step: ops/adagrad.py) and
  Lion, and torch's elementwise classes by name (schemas/optimizer_torch.py) qualify.
- torch.optim.Adagrad itself builds its state in the constructor, over the placeholder: refused.
- Lamb needs the norms of each whole tensor and Muon each whole matrix, and a sub-group holds pieces
  of many tensors and sees them one at a time. Building them would take a first pass over every
  sub-group for Lamb's partial norms (one reduction, as per_tensor.py does in memory) and a second to
  apply the ratios, and for Muon the owner all-to-all of the momentum update per matrix: not built.
"""
from __future__ import annotations

import inspect

import torch

import ops
from schemas.optimizer_torch import TORCH_ELEMENTWISE

_SWAPPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, ops.Adagrad, ops.Lion)
SWAPPABLE_NAMES = "Adam, AdamW, SGD, Adagrad, Lion, or torch's " + ", ".join(TORCH_ELEMENTWISE)
_WHOLE_TENSORS = {
    ops.Lamb: "its trust ratio needs the norms of each whole tensor, and a swapped sub-group holds pieces of "
              "tensors",
    ops.MuonWithAuxAdam: "its Newton-Schulz step needs each whole matrix, and a swapped sub-group holds pieces of "
                         "tensors",
}


def swap_problem(optimizer) -> str | None:
    """Why the swapped step cannot run `optimizer` (module docstring); None when it can."""
    kind = type(optimizer)
    if kind in _SWAPPABLE:
        return None
    if kind.__name__ in TORCH_ELEMENTWISE and kind is getattr(torch.optim, kind.__name__, None):
        return None
    for whole, why in _WHOLE_TENSORS.items():
        if isinstance(optimizer, whole):
            return why
    if kind is torch.optim.Adagrad:
        return "torch.optim.Adagrad makes its state in its constructor; the config's Adagrad (ops.Adagrad) works"
    return f"the swapped step is built for {SWAPPABLE_NAMES}"


def config_name(optimizer) -> str:
    """The `optimizer.type` a user wrote for `optimizer` (Muon builds ops.MuonWithAuxAdam)."""
    return "Muon" if isinstance(optimizer, ops.MuonWithAuxAdam) else type(optimizer).__name__


def constructor_args(kind: type) -> set[str]:
    """The keyword arguments `kind(...)` takes, looking through `**kwargs` forwarding (ops.Adagrad)."""
    for cls in kind.__mro__:
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return set(params)
    return set()
