"""Which optimizers the NVMe tier's swapped step can run (engine/zero/nvme_tier.py, docs/optimizers.md).

`SwappedPartition` (offload/swapped_partition.py) steps one sub-group of a flat partition at a time with
a copy of the configured optimizer over a placeholder parameter. That is the optimizer's own math only
when its update is elementwise (each element from its own gradient, state and per-step scalars) and
its state is made lazily at the first step (the placeholder's state is swapped in and out around it).
- Adam, AdamW (also without bias correction: ops.UncorrectedAdam), SGD, dstrain's Adagrad (torch's, state
  deferred to the first step: ops/adagrad.py) and
  Lion, and torch's elementwise classes by name (schemas/optimizer_torch.py) qualify.
- torch.optim.Adagrad itself builds its state in the constructor, over the placeholder: refused.
- Lamb and Muon need whole tensors (Lamb's norms, Muon's matrices): they step in two passes over the
  sub-groups (nvme_per_tensor.py), Muon's AdamW half with the elementwise step.
"""
from __future__ import annotations

import inspect

import torch

import ops
from schemas.optimizer_torch import TORCH_ELEMENTWISE

_SWAPPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, ops.UncorrectedAdam, ops.Adagrad, ops.Lion)
SWAPPABLE_NAMES = "Adam, AdamW, SGD, Adagrad, Lion, Lamb, Muon, or torch's " + ", ".join(TORCH_ELEMENTWISE)
_PER_TENSOR = (ops.Lamb, ops.MuonWithAuxAdam)  # two passes over the sub-groups (nvme_per_tensor.py)


def swap_problem(optimizer) -> str | None:
    """Why the swapped step cannot run `optimizer` (module docstring); None when it can."""
    kind = type(optimizer)
    if kind in _SWAPPABLE or kind in _PER_TENSOR:
        return None
    if kind.__name__ in TORCH_ELEMENTWISE and kind is getattr(torch.optim, kind.__name__, None):
        return None
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
