"""How each optimizer-state key is laid out, declared per optimizer class — never guessed from shapes.

- ELEMENTWISE: one value per parameter element (exp_avg, sum, momentum_buffer, ...), a tensor of the
  parameter's shape: cut into fragments like the weights (ZeRO partitions, NVMe sub-groups,
  checkpoints), so it reshards across stages and world sizes.
- SCALAR: one value per parameter tensor, the same for every fragment (step, ASGD's eta/mu): a
  number or a one-element tensor, kept whole with each fragment.
- PER_TENSOR: a per-tensor value with its own shape (Adafactor's row/column factors): only where
  every rank holds whole tensors (ZeRO stage 0; stages >= 1 refuse such optimizers).

A class declares its layout with a `STATE_LAYOUT` class attribute ({key: kind}); `STATE_LAYOUTS` covers
torch.optim's classes (read from their `step` in torch 2.13) and this package's, found through the
class's bases (a subclass keeps its base's layout unless it declares its own). The engine reads the
declaration for NVMe's swap files (offload/swapped_partition.py), the CPU and in-memory partitions'
state queries (engine/zero/partitioned.py) and checkpoints (engine/checkpoint/state_layout.py); an
optimizer without one is refused at ZeRO stages >= 1 (`layout_problem`), and state of another shape
than its kind says is refused where it is first seen (`check_state`).
"""
from __future__ import annotations

import torch

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
    # the 1-bit optimizers (ZeRO stage 0 only): read from their steps (their compression state is not
    # per parameter: CompressedOptimizer.state_dict adds it beside)
    "OneBitAdam": {"exp_avg": _E, "exp_avg_sq": _E},
    "ZeroOneAdam": {"exp_avg": _E, "exp_avg_sq": _E, "momentum_accumulator": _E, "lr_sum": _S},
    "OneBitLamb": {"exp_avg": _E, "exp_avg_sq": _E, "exp_avg_sq_fresh": _E, "lamb_coeff_freeze": _S,
                   "last_factor": _S, "scaling_coeff": _S},
}
SETTING = "STATE_LAYOUT"


class StateLayoutError(ValueError):
    """An optimizer's state that its declared layout does not describe (one line, naming the class)."""


def declared_layout(optimizer) -> dict[str, str] | None:
    """{key: kind} the class of `optimizer` declares (module docstring), or None."""
    cls = type(optimizer)
    declared = getattr(cls, SETTING, None)
    if declared is not None:
        return dict(declared)
    for base in cls.__mro__:  # a subclass of a known class (ops.Adagrad of torch's) keeps its layout
        if base.__module__.split(".")[0] in ("torch", "ops") and base.__name__ in STATE_LAYOUTS:
            return dict(STATE_LAYOUTS[base.__name__])
    return None


def layout_problem(optimizer, where: str) -> str | None:
    """Why `optimizer`'s state cannot be placed `where` (e.g. "zero_optimization.stage 2"): no layout."""
    if declared_layout(optimizer) is not None:
        return None
    name = type(optimizer).__name__
    kinds = f"{ELEMENTWISE!r}, {SCALAR!r}"
    return (f"optimizer {name} declares no state layout, so {where} cannot tell which of its state is per "
            f"element; set {name}.{SETTING} = {{state key: {kinds}}} for every key its step creates")


def check_state(optimizer, param: torch.Tensor, state: dict) -> dict[str, str]:
    """{key: kind} of the keys in `state` (`param`'s state after a step), checked against the declaration:
    an undeclared key, or a value whose shape is not what its kind says, raises StateLayoutError."""
    name = type(optimizer).__name__
    declared = declared_layout(optimizer)
    if declared is None:
        raise StateLayoutError(layout_problem(optimizer, "this tier"))
    kinds = {}
    for key, value in state.items():
        kind = declared.get(key)
        if kind is None:
            raise StateLayoutError(f"optimizer {name} holds state {key!r} that its {SETTING} does not name; "
                                   f"add it ({ELEMENTWISE!r} or {SCALAR!r})")
        is_tensor = torch.is_tensor(value)
        if kind == ELEMENTWISE and not (is_tensor and value.shape == param.shape):
            shape = tuple(value.shape) if is_tensor else type(value).__name__
            raise StateLayoutError(f"optimizer {name}'s state {key!r} is declared {ELEMENTWISE} but is {shape} for a "
                                   f"parameter of shape {tuple(param.shape)}; declare its kind as it is")
        if kind == SCALAR and is_tensor and value.numel() != 1:
            raise StateLayoutError(f"optimizer {name}'s state {key!r} is declared {SCALAR} but has shape "
                                   f"{tuple(value.shape)}; a scalar is one value (declare {PER_TENSOR!r} for a "
                                   "whole-tensor value, which only zero_optimization.stage 0 holds)")
        kinds[key] = kind
    return kinds


def probe_state(make_optimizer) -> tuple[torch.optim.Optimizer, torch.Tensor, dict[str, str]]:
    """Step a throw-away optimizer from `make_optimizer([param])` once on a small parameter: (it, the
    parameter, {key: kind} of the state its first step made, checked by `check_state`). Which declared
    keys exist depends on hyperparameters (SGD without momentum makes none), so it is asked, not assumed."""
    probe = torch.nn.Parameter(torch.zeros(7, dtype=torch.float32, device="cpu"))
    optimizer = make_optimizer([probe])
    probe.grad = torch.ones(7, dtype=torch.float32, device="cpu")
    optimizer.step()
    return optimizer, probe, check_state(optimizer, probe, optimizer.state[probe])


def partitioned_state_problem(make_optimizer, where: str) -> str | None:
    """Why state of the optimizer `make_optimizer` builds cannot be cut into ZeRO fragments at `where`:
    a key of another shape than its declared kind, an undeclared key, or per-tensor state."""
    try:
        optimizer, _, kinds = probe_state(make_optimizer)
    except StateLayoutError as wrong:
        return f"{where}: {wrong}"
    except Exception:  # noqa: BLE001 - a copy this cannot build or step on a CPU probe (a client's own
        return None  # constructor, capturable=True): the optimizer itself is not wrong; its checkpoints check keys
    whole = sorted(k for k, kind in kinds.items() if kind == PER_TENSOR)
    if whole:
        return (f"{where}: optimizer {type(optimizer).__name__}'s state {whole} is per tensor, and ZeRO hands "
                "the optimizer dim-0 chunks of each tensor; use zero_optimization.stage 0")
    return None
