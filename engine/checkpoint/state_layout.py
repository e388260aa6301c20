"""How each optimizer-state key is laid out, declared per optimizer class (not guessed from shapes).

- ELEMENTWISE: one value per parameter element (exp_avg, sum, momentum_buffer, ...): saved as rows of
  the parameter, cut and reassembled like the weights, so it reshards across stages and world sizes.
- SCALAR: one value per parameter tensor that is the same for every fragment (step, ASGD's eta/mu):
  saved once per fragment, loaded as is.
- PER_TENSOR: a per-tensor value with its own shape (Adafactor's row/column factors): saved whole with
  every fragment, like a scalar, and loaded as is. Only stage 0 holds such state (ZeRO stages >= 1
  refuse optimizers that need whole tensors: engine/zero/per_tensor.py), where every rank holds whole
  tensors, so it reshards across world sizes unchanged.

A class declares its layout with a `STATE_LAYOUT` class attribute ({key: layout}); the table below
covers torch.optim's classes (read from their `step` in torch 2.13) and ops'. A client optimizer of
another class without `STATE_LAYOUT` falls back to the shape rule (a tensor shaped like its
parameter is elementwise), with a warning naming the class, since nothing else can be known of it.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ELEMENTWISE, SCALAR, PER_TENSOR = "elementwise", "scalar", "per_tensor"

_E, _S = ELEMENTWISE, SCALAR
_ADAM = {"step": _S, "exp_avg": _E, "exp_avg_sq": _E, "max_exp_avg_sq": _E}
STATE_LAYOUTS: dict[str, dict[str, str]] = {
    "Adam": _ADAM, "AdamW": _ADAM, "UncorrectedAdam": _ADAM, "RAdam": _ADAM,
    "NAdam": {**_ADAM, "mu_product": _S},
    "SGD": {"momentum_buffer": _E},
    "Adagrad": {"step": _S, "sum": _E},
    "Adadelta": {"step": _S, "square_avg": _E, "acc_delta": _E},
    "Adamax": {"step": _S, "exp_avg": _E, "exp_inf": _E},
    "ASGD": {"step": _S, "eta": _S, "mu": _S, "ax": _E},
    "RMSprop": {"step": _S, "square_avg": _E, "momentum_buffer": _E, "grad_avg": _E},
    "Rprop": {"step": _S, "prev": _E, "step_size": _E},
    "Adafactor": {"step": _S, "row_var": PER_TENSOR, "col_var": PER_TENSOR, "variance": _E},
    "Lion": {"exp_avg": _E},
    "Lamb": {"step": _S, "exp_avg": _E, "exp_avg_sq": _E},
    "MuonWithAuxAdam": {"momentum_buffer": _E, **_ADAM},
}
_warned: set = set()


def declared_layout(optimizer) -> dict[str, str] | None:
    cls = type(optimizer)
    declared = getattr(cls, "STATE_LAYOUT", None)
    if declared is not None:
        return dict(declared)
    for base in cls.__mro__:  # a subclass of a known class (ops.Adagrad of torch's) keeps its layout
        if base.__module__.split(".")[0] in ("torch", "ops") and base.__name__ in STATE_LAYOUTS:
            return STATE_LAYOUTS[base.__name__]
    return None


def _shape_rule(optimizer) -> dict[str, str]:
    layout = {}
    for owner, state in optimizer.state.items():
        for k, v in state.items():
            if owner.dim() >= 1 and isinstance(v, torch.Tensor) and v.shape == owner.shape:
                layout[k] = ELEMENTWISE
            else:
                layout.setdefault(k, SCALAR)
    return layout


def state_layout(optimizer) -> dict[str, str]:
    """key -> ELEMENTWISE / SCALAR / PER_TENSOR for every state key `optimizer` holds (module docstring)."""
    declared = declared_layout(optimizer)
    if declared is None:
        name = type(optimizer).__name__
        if name not in _warned:
            _warned.add(name)
            logger.warning("optimizer %s declares no STATE_LAYOUT; checkpoints file its state by shape "
                           "(a tensor shaped like its parameter is per element)", name)
        return _shape_rule(optimizer)
    held = {k for state in optimizer.state.values() for k in state}
    unknown = sorted(held - set(declared))
    if unknown:
        raise ValueError(f"optimizer {type(optimizer).__name__} holds state {unknown} that its declared layout "
                         "does not name; add them to its STATE_LAYOUT (engine/checkpoint/state_layout.py)")
    return {k: declared[k] for k in held}


def elementwise_kinds(optimizer) -> set[str]:
    return {k for k, layout in state_layout(optimizer).items() if layout == ELEMENTWISE}
