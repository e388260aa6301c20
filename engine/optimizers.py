"""Optimizers from the config's `optimizer` section, on torch's own kernels.

`build_optimizer` turns an `OptimizerConfig` into a torch optimizer; `resolve_optimizer` also accepts a
user's optimizer object or a callable `f(params)`, as `initialize(optimizer=...)` does.

[Note: kernels] DeepSpeed runs Adam/AdamW through its FusedAdam (GPU) or DeepSpeedCPUAdam (offload)
C++/CUDA ops. dstrain uses torch's fused kernels instead (`fused=True`, available on CPU and GPU since
torch 2.4): no build step to fail, and on CPU ~5-10x faster than torch's foreach path. They compute
the same update; only float rounding order differs.

[Note: Adam is AdamW] `"type": "Adam"` is torch.optim.AdamW (decoupled weight decay) unless
`adam_w_mode: false`, which gives torch.optim.Adam (L2 weight decay), as in DeepSpeed 0.19.8.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

import ops
import schemas
from schemas.optimizer import AdagradParams, AdamParams, MuonParams, OptimizerConfig, SGDParams
from schemas.optimizer_torch import MUP_IMPLS, TORCH_NAMES, torch_kwargs

from .mup_optimizers import build_mup

logger = logging.getLogger(__name__)

# The torch optimizer classes ZeRO wraps without `zero_allow_untested_optimizer` (DeepSpeed's list,
# less its own C++ optimizers, plus the bias-uncorrected Adam that stands for FusedAdam's option).
# The check is on the exact class, as in DeepSpeed.
# dstrain's Lion and Muon stand for DeepSpeed's FusedLion/CPU Lion and MuonWithAuxAdam; its Lamb is
# listed because its trust ratio is per tensor under ZeRO (ops/lamb.py), unlike DeepSpeed's FusedLamb.
ZERO_SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, ops.UncorrectedAdam, ops.Adagrad, ops.Lion, ops.Lamb,
    ops.MuonWithAuxAdam)

ParamGroups = Iterable[Union[torch.Tensor, dict]]


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    """True when ZeRO may wrap `optimizer` without `zero_allow_untested_optimizer`."""
    return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS


def _materialize(param_groups: ParamGroups) -> list:
    """Lists instead of one-shot iterators, so the parameters can be inspected before torch sees them."""
    groups = []
    for group in param_groups:
        if isinstance(group, dict):
            params = group["params"]
            group = {**group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
        groups.append(group)
    return groups


def _all_params(groups: list) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    for group in groups:
        params.extend(group["params"] if isinstance(group, dict) else [group])
    return params


def _kernel_choice(groups: list, fused: Optional[bool]) -> dict:
    """Keyword arguments that select torch's kernel: `fused` when asked or, when unset, when every
    parameter is a floating-point tensor on a device with fused kernels."""
    if fused is not None:
        return {"fused": True} if fused else {}  # not fused: torch's default (foreach on GPU)
    devices = set(_get_fused_kernels_supported_devices())
    params = _all_params(groups)
    if params and all(p.is_floating_point() and p.device.type in devices for p in params):
        return {"fused": True}
    return {}


def _build_adam(groups: list, params: AdamParams, always_decoupled: bool) -> torch.optim.Optimizer:
    decoupled = always_decoupled or params.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kwargs: dict[str, Any] = {"lr": params.lr, "betas": params.betas, "eps": params.eps, "amsgrad": params.amsgrad}
    if params.weight_decay is not None:
        kwargs["weight_decay"] = params.weight_decay
    elif not params.torch_adam:
        kwargs["weight_decay"] = 0.0  # DeepSpeed's FusedAdam default; torch's AdamW would use 0.01
    if not params.bias_correction:  # no torch kernel drops the correction (ops/adam.py)
        return ops.UncorrectedAdam(groups, adam_w_mode=decoupled, **kwargs)
    return cls(groups, **kwargs, **_kernel_choice(groups, params.fused))


def _build_sgd(groups: list, params: SGDParams) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=params.lr, momentum=params.momentum, dampening=params.dampening,
                           weight_decay=params.weight_decay, nesterov=params.nesterov,
                           **_kernel_choice(groups, params.fused))


def _build_adagrad(groups: list, params: AdagradParams) -> torch.optim.Optimizer:
    return ops.Adagrad(groups, lr=params.lr, eps=params.eps, weight_decay=params.weight_decay,
                          lr_decay=params.lr_decay, initial_accumulator_value=params.initial_accumulator_value,
                          **_kernel_choice(groups, params.fused))


# [Note: which parameters Muon takes] DeepSpeed 0.19 (`deepspeed.set_optimizer_flags`): a parameter whose
# layer shape (ds_shape under ZeRO-3) has >= 2 dims and whose name contains neither "embed" nor
# "lm_head" steps with Muon; everything else with AdamW. Each incoming group splits into its two halves,
# keeping its own overrides; the config's `lr` is shared unless `muon_lr`/`adam_lr` set a half's own.
MUON_EXCLUDED_NAMES = ("embed", "lm_head")
_MUON_HALF_KEYS = ("lr", "momentum", "weight_decay")
_ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")


def tag_muon_parameters(model: torch.nn.Module, cfg: Optional[OptimizerConfig]) -> None:
    """Set `use_muon` on every parameter of `model` when the config's optimizer is Muon (note above)."""
    if cfg is None or cfg.type != "Muon":
        return
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        p.use_muon = len(shape) >= 2 and not any(word in name.lower() for word in MUON_EXCLUDED_NAMES)


def _half_settings(params: MuonParams, keys: tuple[str, ...], lr: Optional[float]) -> dict:
    settings = {k: getattr(params, k) for k in keys if k != "lr"}
    if lr is not None or params.lr is not None:
        settings["lr"] = lr if lr is not None else params.lr
    return settings


def _build_muon(groups: list, params: MuonParams) -> torch.optim.Optimizer:
    halves = ((True, _half_settings(params, _MUON_HALF_KEYS, params.muon_lr), _MUON_HALF_KEYS),
              (False, _half_settings(params, _ADAM_HALF_KEYS, params.adam_lr), _ADAM_HALF_KEYS))
    out = []
    for group in groups:
        group = group if isinstance(group, dict) else {"params": [group]}
        missing = [p for p in group["params"] if not hasattr(p, "use_muon")]
        if missing:
            raise ValueError(f"optimizer.type Muon: {len(missing)} parameter(s) in model_parameters are not the "
                             "model's (they carry no use_muon tag); set p.use_muon = True/False on them")
        overrides = {k: v for k, v in group.items() if k != "params"}
        for use_muon, settings, keys in halves:
            half = [p for p in group["params"] if p.requires_grad and bool(p.use_muon) is use_muon]
            if half:
                out.append({"params": half, "use_muon": use_muon, **settings,
                            **{k: v for k, v in overrides.items() if k in keys}})
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[params.ns_dtype]
    return ops.MuonWithAuxAdam(out, adam_w_mode=params.adam_w_mode, ns_dtype=dtype, ns_method=params.ns_method)


def _build_torch(name: str) -> Callable[[list, Any], torch.optim.Optimizer]:
    """A torch.optim class by name; torch's own value checks become config errors naming the params."""
    def build(groups: list, params: Any) -> torch.optim.Optimizer:
        try:
            return getattr(torch.optim, name)(groups, **torch_kwargs(params))
        except (TypeError, ValueError) as exc:
            raise schemas.ConfigError([f"optimizer.params: torch.optim.{name} refused them: {exc}"]) from None
    return build


def _build_from_ops(cls: type[torch.optim.Optimizer]) -> Callable[[list, Any], torch.optim.Optimizer]:
    """Lamb and the 1-bit optimizers take their params' keys as keyword arguments. The 1-bit ones get
    their communicator from ZeRO stage 0 (see ops.compressed_optimizer)."""
    return lambda groups, params: cls(groups, **params.model_dump())


# Canonical type name (schemas.optimizer.PARAMS_MODELS) -> builder(groups, params).
_BUILDERS: dict[str, Callable[[list, Any], torch.optim.Optimizer]] = {
    "Adam": lambda groups, params: _build_adam(groups, params, always_decoupled=False),
    "AdamW": lambda groups, params: _build_adam(groups, params, always_decoupled=True),
    "SGD": _build_sgd,
    "Lamb": _build_from_ops(ops.Lamb),
    "Lion": _build_from_ops(ops.Lion),
    "Adagrad": _build_adagrad,
    "Muon": _build_muon,
    "OneBitAdam": _build_from_ops(ops.OneBitAdam),
    "ZeroOneAdam": _build_from_ops(ops.ZeroOneAdam),
    "OneBitLamb": _build_from_ops(ops.OneBitLamb),
    **{name: _build_torch(name) for name in TORCH_NAMES},
    **{name: build_mup(name) for name in MUP_IMPLS},
}


def build_optimizer(param_groups: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer `cfg` describes over `param_groups` (tensors, or dicts with "params" and
    per-group overrides, as torch accepts)."""
    return _BUILDERS[cfg.type](_materialize(param_groups), cfg.params)


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or (hasattr(obj, "param_groups") and hasattr(obj, "step"))


def resolve_optimizer(optimizer: Any, model_parameters: Optional[ParamGroups],
                      cfg: Optional[OptimizerConfig]) -> Optional[torch.optim.Optimizer]:
    """What `initialize(optimizer=...)` ends up with, as DeepSpeed decides it.

    An optimizer object is used as is; a callable is called as `optimizer(model_parameters)`; with
    neither, the config's `optimizer` section is built, or None when there is none (an engine without
    an optimizer, e.g. for evaluation). A passed-in optimizer overrides the config section. Param
    groups without parameters are dropped, as DeepSpeed does.
    """
    if optimizer is None:
        if cfg is None:
            return None
        if model_parameters is None:
            raise ValueError("the config has an 'optimizer' section but initialize() got no "
                             "model_parameters; pass model_parameters=model.parameters()")
        return _drop_empty_groups(build_optimizer(model_parameters, cfg))
    if cfg is not None:
        logger.warning("initialize(optimizer=...) overrides the config's 'optimizer' section (%s)", cfg.type)
    if _is_optimizer(optimizer):
        result = optimizer
    elif callable(optimizer):
        result = optimizer(model_parameters)
        if not _is_optimizer(result):
            raise TypeError(f"the optimizer callable returned {type(result).__name__}, not an optimizer")
    else:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable f(params), "
                        f"got {type(optimizer).__name__}")
    return _drop_empty_groups(result)


def _drop_empty_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's engine drops the param groups without parameters from the optimizer it built or was
    given, before the LR schedule is built: a per-group schedule value (`warmup_max_lr: [...]`) counts
    only the groups that remain, and `get_lr()` reports one lr per remaining group. An optimizer with no
    parameters at all (a pipeline stage of parameter-free layers) keeps its groups: it still steps."""
    kept = [g for g in optimizer.param_groups if len(g["params"]) > 0]
    if kept:
        optimizer.param_groups[:] = kept
    return optimizer
