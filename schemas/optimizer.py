"""The `optimizer` section: `{"type": ..., "params": {...}}`, with params typed per optimizer type.

Type names are matched case-insensitively, as DeepSpeed does, and stored in their canonical spelling
("adamw" -> "AdamW"). Each type has its own params model, so a typo inside `optimizer.params` is an
error naming `optimizer.params.<key>` with a did-you-mean.

[Note: Adam is AdamW] DeepSpeed 0.19.8 runs `"type": "Adam"` with decoupled weight decay (AdamW) unless
`adam_w_mode: false`. dstrain keeps that: `Adam` + `adam_w_mode: false` is classic Adam with L2 decay.

To switch on an optimizer that is listed in `NOT_BUILT_OPTIMIZERS`: write its params model here, add it
to `PARAMS_MODELS`, remove the name from `NOT_BUILT_OPTIMIZERS`, and add a builder in
`engine/optimizers.py`.
"""
from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar, Literal, Optional, Tuple, Union

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from schemas.base import StrictModel
from schemas.optimizer_torch import MUP_IMPLS, TORCH_NAMES, LazyParamsModels

# Hints for keys that other tools put in optimizer params but that live elsewhere in the config.
_KEY_HINTS = {
    "max_grad_norm": "gradient clipping is the top-level 'gradient_clipping' key, not an optimizer param",
}


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[word.lower()]] if word.lower() in lowered else []
    return f"did you mean '{close[0]}'? " if close else ""


def list_to_tuple(value: Any) -> Any:
    """JSON has no tuples; the models are strict, so a list becomes a tuple before validation."""
    return tuple(value) if isinstance(value, list) else value


Betas = Annotated[Tuple[float, float], BeforeValidator(list_to_tuple)]


def _betas_in_unit_interval(betas: Tuple[float, float]) -> Tuple[float, float]:
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
    return betas


UnitBetas = Annotated[Betas, AfterValidator(_betas_in_unit_interval)]


def _custom(loc: tuple, message: str, value: Any) -> InitErrorDetails:
    # The message goes through ctx so that braces in user input cannot break the template.
    return {"type": PydanticCustomError("invalid_param", "{message}", {"message": message}),
            "loc": loc, "input": value}


def _unknown_key(key: str, value: Any, allowed: list[str], owner: str) -> InitErrorDetails:
    # Error type "unknown_key" (not pydantic's extra_forbidden): the hint depends on `type`, which a
    # formatter walking the params union could not know. ctx["hint"] is the hint alone.
    close = _did_you_mean(key, allowed).strip()
    hint = _KEY_HINTS.get(key) or close or f"valid keys: {', '.join(allowed)}"
    return {"type": PydanticCustomError("unknown_key", "unknown key for {owner}; {hint}",
                                        {"owner": owner, "hint": hint}),
            "loc": (key,), "input": value}


def param_errors(title: str, errors: list[InitErrorDetails]) -> ValidationError:
    """`errors` as one ValidationError; raised in a field validator, pydantic prefixes each `loc` with
    that field's path, so every problem keeps its full key path."""
    return ValidationError.from_exception_data(title, errors)


def validate_params(model: type[StrictModel], value: Any, owner: str) -> StrictModel:
    """Validate `value` (a section's `params` dict) against `model`.

    Every problem keeps its own key path; an unknown key says what was probably meant and which keys
    `owner` (e.g. "optimizer 'Adam'") accepts.
    """
    try:
        return model.model_validate({} if value is None else value)
    except ValidationError as exc:
        allowed = list(model.model_fields)
        details: list[InitErrorDetails] = []
        for err in exc.errors():
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                details.append(_unknown_key(str(err["loc"][0]), err["input"], allowed, owner))
                continue
            detail: InitErrorDetails = {"type": err["type"], "loc": err["loc"], "input": err["input"]}
            if "ctx" in err:
                detail["ctx"] = err["ctx"]
            details.append(detail)
        raise param_errors(exc.title, details) from None


def resolve_type_name(value: Any, built: list[str], not_built: list[str], other_hint: dict[str, str],
                      section: str) -> str:
    """Canonical spelling of a `type` value, or a ValueError saying what is allowed."""
    if not isinstance(value, str):
        raise ValueError(f"must be a string naming the {section} type, one of: {', '.join(built)}")
    by_lower = {name.lower(): name for name in built + not_built}
    canonical = by_lower.get(value.lower())
    if canonical in built:
        return canonical
    if canonical is not None:
        raise ValueError(f"'{canonical}' is not built yet in dstrain (built: {', '.join(built)})")
    if value.lower() in other_hint:
        raise ValueError(other_hint[value.lower()])
    later = f" (not built yet: {', '.join(not_built)})" if not_built else ""
    raise ValueError(f"'{value}' is not a known {section} type; {_did_you_mean(value, built + not_built)}"
                     f"valid types: {', '.join(built)}{later}")


class TypedSection(StrictModel):
    """A `{"type": ..., "params": {...}}` section whose params model depends on `type`. Subclasses set
    the class variables and declare `params` as the union of their params models."""

    section: ClassVar[str]
    params_models: ClassVar[dict[str, type[StrictModel]]]
    not_built: ClassVar[list[str]] = []
    other_hints: ClassVar[dict[str, str]] = {}

    type: str

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        return resolve_type_name(value, list(cls.params_models), cls.not_built, cls.other_hints, cls.section)

    @field_validator("params", mode="before", check_fields=False)
    @classmethod
    def _typed_params(cls, value: Any, info: ValidationInfo) -> StrictModel:
        kind = info.data.get("type")
        if kind is None:
            # `type` already failed; its error is the one to read. A placeholder keeps params quiet.
            return next(iter(cls.params_models.values())).model_construct()
        params = validate_params(cls.params_models[kind], value, f"{cls.section} '{kind}'")
        cls._check_params(kind, params)
        return params

    @classmethod
    def _check_params(cls, kind: str, params: StrictModel) -> None:
        """Checks across `type` and `params`; raise `param_errors(...)` to keep the key paths."""


class AdamParams(StrictModel):
    """Params of `Adam` and `AdamW` (torch's Adam/AdamW kernels; fused on CPU and GPU by default)."""

    lr: float = Field(1e-3, ge=0.0)
    """Learning rate (default 1e-3, DeepSpeed's FusedAdam default); a scheduler may overwrite it. An
    unfilled `"auto"` is an error, never this default (schemas/auto.py)."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square, each in [0, 1)."""
    eps: float = Field(1e-8, ge=0.0)
    """Added to the denominator for numerical stability."""
    weight_decay: Optional[float] = Field(None, ge=0.0)
    """Decoupled (AdamW) or L2 (`Adam` with `adam_w_mode: false`) weight decay. Unset: 0.0, as
    DeepSpeed's FusedAdam; with `torch_adam: true`, torch's own default (0.01 for AdamW)."""
    amsgrad: bool = False
    """Use the AMSGrad variant (torch's kernels support it; DeepSpeed's FusedAdam does not)."""
    bias_correction: bool = True
    """Divide the moments by 1 − β^t (Adam's bias correction; torch's kernels). false: DeepSpeed's
    FusedAdam/CPU Adam without it, step lr·m/(√v + ε) (ops.UncorrectedAdam, torch's foreach ops;
    not with `fused: true`, which names torch's fused kernel)."""
    adam_w_mode: bool = True
    """`Adam` only: true (default, as DeepSpeed 0.19.8) = decoupled weight decay (AdamW); false =
    classic Adam with L2 decay. `AdamW` is always decoupled."""
    torch_adam: bool = False
    """Accepted for DeepSpeed compatibility: dstrain runs torch's kernels (true contradicts
    bias_correction false). Only effect: an unset `weight_decay` takes torch's default instead of 0.0."""
    fused: Optional[bool] = None
    """dstrain: torch's fused kernel (true), torch's default kernel, foreach on GPU and a for-loop on
    CPU (false), or fused whenever all parameters are floating point on a device torch has fused
    kernels for (unset; on CPU ~5-10x faster than foreach)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: Tuple[float, float]) -> Tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas

    @field_validator("torch_adam")
    @classmethod
    def _torch_adam_corrects_the_bias(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("bias_correction") is False:
            raise ValueError("true contradicts bias_correction false: torch's Adam always corrects the bias "
                             "(DeepSpeed fails on it too); remove one of them")
        return value

    @field_validator("fused")
    @classmethod
    def _fused_needs_bias_correction(cls, value: Optional[bool], info: ValidationInfo) -> Optional[bool]:
        if value and info.data.get("bias_correction") is False:
            raise ValueError("true needs bias_correction true: torch's fused kernel always corrects the bias; "
                             "remove fused (bias_correction false runs on torch's foreach ops)")
        return value


class SGDParams(StrictModel):
    """Params of `SGD` (torch.optim.SGD)."""

    lr: float = Field(1e-3, ge=0.0)
    """Learning rate (default 1e-3, torch's default)."""
    momentum: float = Field(0.0, ge=0.0)
    """Momentum factor; 0 disables momentum."""
    dampening: float = Field(0.0, ge=0.0)
    """Dampening for momentum."""
    weight_decay: float = Field(0.0, ge=0.0)
    """L2 penalty added to the gradient."""
    nesterov: bool = False
    """Nesterov momentum; needs `momentum > 0` and `dampening == 0`."""
    fused: Optional[bool] = None
    """dstrain: torch's fused SGD kernel (true), torch's default kernel (false), or fused where
    supported (unset)."""

    @field_validator("nesterov")
    @classmethod
    def _nesterov_needs_momentum(cls, value: bool, info: ValidationInfo) -> bool:
        if value and (info.data.get("momentum", 0.0) <= 0.0 or info.data.get("dampening", 0.0) != 0.0):
            raise ValueError("nesterov needs momentum > 0 and dampening == 0")
        return value


class _MomentParams(StrictModel):
    """Adam-moment hyperparameters shared by Lamb and the 1-bit optimizers."""

    lr: float = Field(1e-3, ge=0.0)
    """Learning rate (DeepSpeed's default 1e-3); a scheduler may overwrite it."""
    betas: UnitBetas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square, each in [0, 1)."""
    eps: float = Field(1e-8, ge=0.0)
    """Added to the denominator for numerical stability."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (added to the update, as DeepSpeed)."""
    bias_correction: bool = True
    """Correct the moments' initialisation bias (dstrain keeps Adam's correction in the 1-bit
    optimizers too, so their warm-up is exactly Adam/LAMB; false drops it, as DeepSpeed's 1-bit code)."""


def _not_above(upper: str):
    """A validator of a lower clip: at most the upper clip `upper` (declared before it, so validated first)."""
    def check(cls, value: float, info: ValidationInfo) -> float:
        top = info.data.get(upper)
        if top is not None and value > top:
            raise ValueError(f"{value} is above {upper} ({top}); the clip range must not be empty")
        return value
    return check


class LambParams(_MomentParams):
    """Params of `Lamb` (ops.Lamb: LAMB, arXiv:1904.00962, with DeepSpeed's trust-ratio clipping)."""

    max_coeff: float = Field(10.0, gt=0.0)
    """Upper clip of the trust ratio ‖w‖/‖update‖."""
    min_coeff: float = Field(0.01, ge=0.0)
    """Lower clip of the trust ratio."""

    _coeff_range = field_validator("min_coeff")(classmethod(_not_above("max_coeff")))


class _OneBitCommParams(_MomentParams):
    amsgrad: bool = False
    """Only false: the 1-bit optimizers freeze the variance, which AMSGrad's max would contradict."""
    cuda_aware: bool = False
    """DeepSpeed's MPI-backend flag; accepted, no effect (dstrain's collectives use torch.distributed)."""
    comm_backend_name: Literal["nccl", "gloo", "compressed"] = "nccl"
    """Accepted for DeepSpeed compatibility: the compressed all-reduce always runs on torch.distributed
    collectives of the process group's backend (NCCL on GPUs, gloo on CPUs); "mpi" and "hccl" are not built."""

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, value: bool) -> bool:
        if value:
            raise ValueError("the 1-bit optimizers do not support amsgrad (their variance is frozen); remove the key")
        return value


class OneBitAdamParams(_OneBitCommParams):
    """Params of `OneBitAdam` (ops.OneBitAdam, arXiv:2102.02888)."""

    freeze_step: int = Field(100000, ge=1)
    """Warm-up steps of plain Adam with full-precision gradient all-reduce; afterwards the variance
    is frozen and momentum travels 1-bit compressed (DeepSpeed suggests 15-25% of the total steps)."""


class ZeroOneAdamParams(_OneBitCommParams):
    """Params of `ZeroOneAdam` (ops.ZeroOneAdam, arXiv:2202.06009)."""

    var_freeze_step: int = Field(100000, ge=1)
    """Last step at which the variance may be updated (usually the end of the LR warm-up)."""
    var_update_scaler: int = Field(16, ge=1)
    """κ: the interval between variance updates doubles every this many updates."""
    local_step_scaler: int = Field(32678, ge=1)
    """After var_freeze_step, the interval between 1-bit synchronisations doubles every this many steps."""
    local_step_clipper: int = Field(16, ge=1)
    """H: the largest interval between 1-bit synchronisations (local steps in between)."""


class OneBitLambParams(_OneBitCommParams):
    """Params of `OneBitLamb` (ops.OneBitLamb, arXiv:2104.06069)."""

    freeze_step: int = Field(100000, ge=1)
    """Warm-up steps of plain LAMB; afterwards momentum travels 1-bit compressed."""
    max_coeff: float = Field(10.0, gt=0.0)
    """Upper clip of the LAMB trust ratio during warm-up."""
    min_coeff: float = Field(0.01, ge=0.0)
    """Lower clip of the LAMB trust ratio during warm-up."""
    coeff_beta: float = Field(0.9, ge=0.0, lt=1.0)
    """EMA coefficient of the trust ratio tracked during warm-up (the frozen ratio); keep
    1/(1 − coeff_beta) <= freeze_step."""
    factor_max: float = Field(4.0, gt=0.0)
    """Upper clip of the factor applied to the frozen trust ratio after warm-up."""
    factor_min: float = Field(0.5, ge=0.0)
    """Lower clip of that factor."""
    factor_threshold: float = Field(0.1, ge=0.0)
    """Largest relative change of the factor from one step to the next."""

    _coeff_range = field_validator("min_coeff")(classmethod(_not_above("max_coeff")))
    _factor_range = field_validator("factor_min")(classmethod(_not_above("factor_max")))


class LionParams(StrictModel):
    """Params of `Lion` (ops.Lion: Chen et al., arXiv:2302.06675; DeepSpeed's FusedLion/CPU Lion defaults)."""

    lr: float = Field(1e-3, ge=0.0)
    """Learning rate (DeepSpeed's default 1e-3; the paper suggests 3-10x smaller than AdamW's)."""
    betas: UnitBetas = (0.9, 0.999)
    """β1 interpolates the update direction sign(β1·m + (1−β1)·g); β2 is the momentum's decay."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay: x ← x·(1 − lr·wd) before the signed step."""


class AdagradParams(StrictModel):
    """Params of `Adagrad` (torch.optim.Adagrad, whose update is DeepSpeed's CPU Adagrad's:
    s ← s + g², x ← x − lr·g/(√s + ε), with L2 weight decay added to g)."""

    lr: float = Field(1e-2, ge=0.0)
    """Learning rate (default 1e-2, DeepSpeed's CPU Adagrad and torch's)."""
    eps: float = Field(1e-10, ge=0.0)
    """Added to √s (default 1e-10)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """L2 penalty added to the gradient."""
    lr_decay: float = Field(0.0, ge=0.0)
    """torch's: lr/(1 + (t−1)·lr_decay) (0 = DeepSpeed's constant lr)."""
    initial_accumulator_value: float = Field(0.0, ge=0.0)
    """torch's: the starting value of s (0 as DeepSpeed)."""
    fused: Optional[bool] = None
    """dstrain: torch's fused CPU kernel (true), its default kernel (false), or fused where supported (unset)."""


class MuonParams(StrictModel):
    """Params of `Muon` (ops.MuonWithAuxAdam, DeepSpeed 0.19's `MuonWithAuxAdam`): hidden 2-D weights
    (ndim ≥ 2, name without "embed"/"lm_head") step with Muon, every other parameter with AdamW."""

    lr: Optional[float] = Field(None, ge=0.0)
    """Shared learning rate of both halves, unless `muon_lr` / `adam_lr` set theirs."""
    muon_lr: Optional[float] = Field(None, ge=0.0)
    """Learning rate of the Muon half (else `lr`, else 0.02)."""
    adam_lr: Optional[float] = Field(None, ge=0.0)
    """Learning rate of the AdamW half (else `lr`, else 3e-4)."""
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon's momentum β: m ← β·m + (1−β)·g, Nesterov update (1−β)·g + β·m."""
    betas: UnitBetas = (0.9, 0.95)
    """The AdamW half's betas (DeepSpeed's Muon default)."""
    eps: float = Field(1e-10, ge=0.0)
    """The AdamW half's ε (DeepSpeed's Muon default)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay of both halves."""
    adam_w_mode: bool = True
    """The non-Muon half: decoupled weight decay (true) or L2 (false), as DeepSpeed."""
    ns_method: Literal["standard", "gram"] = "standard"
    """The Newton-Schulz form: "standard" (the quintic iteration on X). DeepSpeed's default "gram" (the same
    polynomial evaluated on X·Xᵀ, restarted, in fp16) is not built yet; a config without the key gets
    "standard", which equals it up to rounding."""
    ns_dtype: Literal["fp32", "bf16"] = "fp32"
    """dstrain: the Newton-Schulz matmul dtype. fp32 (default; bf16 matmuls are ~400x slower on CPUs
    without bf16 units); bf16 only on accelerators."""

    @field_validator("ns_method")
    @classmethod
    def _gram_not_built(cls, value: str) -> str:
        if value == "gram":
            raise ValueError("'gram' (DeepSpeed's Gram-matrix Newton-Schulz) is not built yet in dstrain; use "
                             "'standard' (the same iteration on X, equal up to rounding) or remove the key")
        return value


OptimizerParams = Union[AdamParams, SGDParams, LambParams, OneBitAdamParams, ZeroOneAdamParams, OneBitLambParams,
                        LionParams, AdagradParams, MuonParams, StrictModel]

# Canonical type name -> its params model (None: a torch.optim class's, made on first use by
# schemas/optimizer_torch.py). The order is the order of error messages.
PARAMS_MODELS: dict[str, Optional[type[StrictModel]]] = LazyParamsModels(
    {"Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Lamb": LambParams, "Lion": LionParams,
     "Adagrad": AdagradParams, "Muon": MuonParams, "OneBitAdam": OneBitAdamParams,
     "ZeroOneAdam": ZeroOneAdamParams, "OneBitLamb": OneBitLambParams, **{name: None for name in TORCH_NAMES},
     **{name: None for name in MUP_IMPLS}})

# The config types ZeRO stages 1-3 take without `zero_allow_untested_optimizer`: DeepSpeed's list
# (Adam, AdamW, Adagrad, Lion, Muon; MuAdam and MuAdamW, which are torch's Adam and AdamW classes there,
# but not MuSGD, torch's SGD) and Lamb, whose trust ratio dstrain computes per tensor under ZeRO.
ZERO_TESTED_TYPES = ("Adam", "AdamW", "Adagrad", "Lion", "Lamb", "Muon", "MuAdam", "MuAdamW")

# The types that average their momentum themselves after warm-up (ZeRO stage 0 only).
ONEBIT_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")

# DeepSpeed optimizer types that dstrain does not build (none today); naming one is a clear "not built
# yet" error. mup's MuAdam/MuAdamW/MuSGD are built through the optional `mup` package
# (engine/mup_optimizers.py).
NOT_BUILT_OPTIMIZERS: list[str] = []


class OptimizerConfig(TypedSection):
    """`optimizer`: which optimizer the engine builds, and its hyperparameters. An optimizer passed to
    `initialize(optimizer=...)` overrides this section."""

    section: ClassVar[str] = "optimizer"
    params_models: ClassVar[dict[str, type[StrictModel]]] = PARAMS_MODELS
    not_built: ClassVar[list[str]] = NOT_BUILT_OPTIMIZERS

    type: str
    """Adam, AdamW, SGD, Lamb, Lion, Adagrad, Muon, OneBitAdam, ZeroOneAdam, OneBitLamb, MuAdam, MuAdamW,
    MuSGD (mup's, with the `mup` package installed: their params are torch's Adam, AdamW, SGD's), or a torch.optim
    class name (ASGD, Adadelta, Adamax, NAdam, RAdam, RMSprop, Rprop, Adafactor, SparseAdam, LBFGS);
    case-insensitive, stored canonically."""
    params: OptimizerParams = Field(default_factory=dict)
    """Hyperparameters of `type`; see the *Params models here, and for a torch.optim class its
    constructor's keyword arguments. Missing keys take their defaults."""
    legacy_fusion: bool = False
    """DeepSpeed's legacy fused fp16 optimizer (not built yet: true is rejected)."""

    @classmethod
    def _check_params(cls, kind: str, params: StrictModel) -> None:
        if kind == "AdamW" and "adam_w_mode" in params.model_fields_set and not params.adam_w_mode:
            raise param_errors("params", [_custom(
                ("adam_w_mode",), "false contradicts type AdamW (always decoupled weight decay); for "
                "L2 weight decay use type Adam with adam_w_mode false", False)])
