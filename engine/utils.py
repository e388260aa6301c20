"""Full fp32 views of one parameter on any rank: DeepSpeed's `deepspeed.utils.safe_get_full_*` family.

    from engine.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
    w = safe_get_full_fp32_param(model.l1.weight)      # fp32 master weight, full shape
    g = safe_get_full_grad(model.l1.weight)            # reduced, averaged, unscaled gradient
    m = safe_get_full_optimizer_state(model.l1.weight, "exp_avg")
    w_r = safe_get_local_fp32_param(model.l1.weight)   # this rank's rows only, no collective
    m_r = safe_get_local_optimizer_state(model.l1.weight, "exp_avg")

Call them on every rank at the same time: at stages 1 and above the pieces live on different ranks and
are all-gathered. `safe_get_full_grad` is meaningful between the boundary's backward and `step()`.
[Note: who answers] `build_zero_optimizer` tags each trainable parameter with the ZeRO optimizer that
owns it (`param._dstrain_zero`). A partitioned stage answers through `full_fp32_param`, `full_grad`
and `full_optimizer_state`; a later stage (3) only has to provide the same three methods. Stage 0
keeps full tensors, which are read here directly. A parameter no optimizer owns gives None.
"""
from __future__ import annotations

import torch

OWNER_ATTR = "_dstrain_zero"


def tag_parameters(zero_optimizer, params) -> None:
    for p in params:
        setattr(p, OWNER_ATTR, zero_optimizer)


def _owner(param: torch.nn.Parameter, call: str, state: str):
    """`param`'s ZeRO optimizer; an error naming reload_states while `state` is away (engine.offload_states:
    torch's 'setStorage ... out of bounds' otherwise)."""
    zopt = getattr(param, OWNER_ATTR, None)
    away = getattr(zopt, "offloaded_states", None)
    if away is not None:
        from .offload_states import OffloadStateTypeEnum
        away.require(call, (OffloadStateTypeEnum(state),), owner="engine.utils.")
    return zopt


def _stage0_master(zopt, param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Stage 0: the fp32 master copy of `param` under fp16/bf16, else the parameter itself."""
    if zopt.master is None:
        return param
    index = next(i for i, p in enumerate(zopt.master.model_params) if p is param)
    return zopt.master.master_params[index]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    zopt = _owner(param, "safe_get_full_fp32_param", "hp_params")
    if zopt is None:
        return None
    if hasattr(zopt, "full_fp32_param"):
        return zopt.full_fp32_param(param)
    return _stage0_master(zopt, param).detach().float().clone()


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    zopt = _owner(param, "safe_get_full_grad", "lp_grads")
    if zopt is None:
        return None
    if hasattr(zopt, "full_grad"):
        return zopt.full_grad(param)
    view = zopt.buckets.views.get(param)
    return None if view is None else view.detach().float() / zopt.guard.scaler.loss_scale


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    zopt = _owner(param, "safe_get_full_optimizer_state", "optim_states")
    if zopt is None:
        return None
    if hasattr(zopt, "full_optimizer_state"):
        return zopt.full_optimizer_state(param, optim_state_key)
    value = zopt.optimizer.state.get(_stage0_master(zopt, param), {}).get(optim_state_key)
    return value.detach().float().clone() if isinstance(value, torch.Tensor) else value


def _local(param: torch.nn.Parameter, method: str, *args):
    """This rank's rows of `param` (a partitioned stage's fragment; stage 0 holds whole tensors)."""
    zopt = _owner(param, f"safe_get_{method}", "optim_states" if args else "hp_params")
    if zopt is None:
        return None
    if hasattr(zopt, method):
        return getattr(zopt, method)(param, *args)
    return (safe_get_full_optimizer_state if args else safe_get_full_fp32_param)(param, *args)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    return _local(param, "local_fp32_param")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    return _local(param, "local_optimizer_state", optim_state_key)
