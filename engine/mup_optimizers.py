"""mup's μP optimizers (`"type": "MuAdam"`, `"MuAdamW"`, `"MuSGD"`), built by the `mup` package as
DeepSpeed 0.19 builds them (`mup.MuAdam(model_parameters, **params)`).

mup is an optional dependency (`pip install --no-deps mup`; README). Its optimizers are torch's Adam,
AdamW and SGD over param groups split by each parameter's `infshape`, which `mup.set_base_shapes` puts
on the user's model: a matrix-like parameter's group gets lr / width_mult (Adam) or lr / its fan-in to
fan-out ratio (SGD), with the weight decay scaled the other way. ZeRO keeps one flat per param group
(engine/zero/partition.py), so every flat holds parameters of one scaling and its fragments step with
their own parameter's lr at every stage and tier.

[Note: LR schedules] The scaling lives in the groups' `lr`. A schedule given one absolute lr for every
group (a scalar `warmup_max_lr`, here as in DeepSpeed) overwrites it; one that scales each group's own
lr keeps it (WarmupLR without `warmup_max_lr`, torch's LambdaLR).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import schemas
from schemas.optimizer_torch import MUP_IMPLS, torch_kwargs


def build_mup(name: str) -> Callable[[list, Any], torch.optim.Optimizer]:
    def build(groups: list, params: Any) -> torch.optim.Optimizer:
        try:
            import mup
        except ImportError:
            raise schemas.ConfigError([f"optimizer.type: {name} needs the mup package, which is not installed; "
                                       "pip install --no-deps mup (README: mup)"]) from None
        flat = [p for group in groups for p in (group["params"] if isinstance(group, dict) else [group])]
        missing = [tuple(p.shape) for p in flat if not hasattr(p, "infshape")]
        if missing:
            raise schemas.ConfigError([f"optimizer.type: {name}: {len(missing)} parameter(s) have no mup base shape "
                                       f"(first: shape {missing[0]}); call mup.set_base_shapes(model, base_model) "
                                       "before engine.initialize"])
        _refuse_placeholder_shapes(name, flat)
        kwargs = torch_kwargs(params)
        kwargs.setdefault("lr", 1e-3)  # mup reads it (process_param_groups); torch's default for all three
        try:
            return getattr(mup, name)(groups, **kwargs)
        except (TypeError, ValueError) as exc:
            raise schemas.ConfigError([f"optimizer.params: mup.{name} (torch.optim.{MUP_IMPLS[name]}) refused "
                                       f"them: {exc}"]) from None
    return build


def _refuse_placeholder_shapes(name: str, params: list) -> None:
    """[Note: base shapes of a model built in zero.Init] `mup.set_base_shapes` reads `p.shape`; on a
    parameter zero.Init partitioned that is the placeholder's (0, *rest) (zero/stage3_params.py), so dim 0
    counted as a width of multiplier 0 (a first layer's width_mult 0: MuSGD's lr times 0) or a finite
    output dim became a width (a readout stepped as matrix-like), silently. The real sizes cannot be told
    from such an infshape afterwards: refused, naming the way to read the full shapes."""
    wrong = [(tuple(p.ds_shape), tuple(d.dim for d in p.infshape)) for p in params
             if hasattr(p, "ds_shape") and tuple(d.dim for d in p.infshape) != tuple(p.ds_shape)]
    if wrong:
        full, seen = wrong[0]
        raise schemas.ConfigError([
            f"optimizer.type: {name}: mup.set_base_shapes read the empty placeholder of {len(wrong)} parameter(s) "
            f"that engine.zero.Init partitioned (first: shape {full}, its infshape {seen}); call it with them "
            "gathered: with engine.zero.GatheredParameters(list(model.parameters()), modifier_rank=0): "
            "mup.set_base_shapes(model, base_model)"])
