"""`optimizer.type` naming a `torch.optim` class that DeepSpeed has no name for (DeepSpeed 0.19 falls
back to `getattr(torch.optim, type)`): its params model is read off the class's constructor, so an
unknown param is an error naming `optimizer.params.<name>`, and every key the constructor takes is
accepted (torch checks the values when the optimizer is built).

[Note: elementwise vs per-tensor] ZeRO stages 1-3 give the optimizer one flat fp32 tensor of dim-0
chunks per param group (engine/zero/partition.py). An optimizer whose update of an element depends only
on that element's own gradient, state and a per-step scalar ("elementwise") computes exactly what it
computes on the whole tensors there, padding included (zero weight, zero gradient stays zero). One whose
step needs a whole tensor (norms, factorisation, sparsity) or all parameters as one vector
("per-tensor") would be applied to chunks; those are refused at stage ≥ 1. The table is by reading
each class's `step` in torch 2.13.
"""
from __future__ import annotations

import inspect
from typing import Any

from pydantic import create_model

from schemas.base import StrictModel

# torch.optim classes whose update is elementwise (module note); SGD/Adam/AdamW/Adagrad have our own models.
TORCH_ELEMENTWISE = ("ASGD", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop")

# torch.optim classes whose step needs whole tensors, and why (refused at ZeRO stage >= 1).
TORCH_PER_TENSOR = {
    "Adafactor": "it factors each matrix's second moment into row and column sums",
    "SparseAdam": "it needs sparse gradients, which ZeRO's dense flat partitions do not hold",
}

# torch.optim classes engine.step() cannot drive at all, and why (refused at every stage).
TORCH_NEEDS_CLOSURE = {
    "LBFGS": "it re-evaluates the loss through a closure on every step and treats all parameters as one "
             "vector; engine.step() takes no closure. Pass it as initialize(optimizer=...) and step it yourself",
}

_SKIPPED_ARGS = ("self", "params")


# mup's optimizers (engine/mup_optimizers.py) pass their params on to this torch class, as DeepSpeed does.
MUP_IMPLS = {"MuAdam": "Adam", "MuAdamW": "AdamW", "MuSGD": "SGD"}


def _params_model(name: str) -> type[StrictModel]:
    """A strict model whose fields are the constructor's keyword arguments, with torch's defaults."""
    import torch  # here, not at the top: schemas/ is imported by the launcher, which never needs torch
    cls = getattr(torch.optim, MUP_IMPLS.get(name, name))
    fields: dict[str, Any] = {}
    for arg in inspect.signature(cls.__init__).parameters.values():
        if arg.name in _SKIPPED_ARGS or arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        default = None if arg.default is inspect.Parameter.empty else arg.default
        fields[arg.name] = (Any, default)
    model = create_model(f"Torch{name}Params", __base__=StrictModel, **fields)
    model.__doc__ = f"Params of `{name}`: the keyword arguments of torch.optim.{cls.__name__} (its defaults)."
    return model


TORCH_NAMES = (*TORCH_ELEMENTWISE, *TORCH_PER_TENSOR, *TORCH_NEEDS_CLOSURE)


class LazyParamsModels(dict):
    """Type name -> params model, where a torch name's model is made from its class on first use."""

    def __getitem__(self, name: str) -> type[StrictModel]:
        value = super().__getitem__(name)
        if value is None:
            value = _params_model(name)
            self[name] = value
        return value


def torch_kwargs(params: StrictModel) -> dict[str, Any]:
    """The keyword arguments the user set (the others keep torch's defaults inside torch)."""
    return {k: getattr(params, k) for k in params.model_fields_set}
