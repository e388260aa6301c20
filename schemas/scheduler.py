"""The `scheduler` section: `{"type": ..., "params": {...}}`, DeepSpeed's five LR schedules.

Parameter names and defaults are DeepSpeed 0.19.8's (`deepspeed/runtime/lr_schedules.py`); the
formulas live beside the code in `engine/schedules.py`. Type names are matched case-insensitively and
stored canonically. Values DeepSpeed only warns about (an unknown `warmup_type`) are errors here.

[Note: step counts] Every step count in this section counts *optimizer* steps: the engine advances
the schedule once per applied optimizer step (each gradient-accumulation boundary, not on skipped
overflow steps), as DeepSpeed does.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Tuple, Union

from pydantic import Field, PlainSerializer, PlainValidator

from schemas.base import Size, StrictModel
from schemas.optimizer import TypedSection



def _per_group_value(value: Any) -> Union[float, Tuple[float, ...]]:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0

    if number(value):
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(number(v) for v in value):
        return tuple(float(v) for v in value)
    raise ValueError(f"must be a number >= 0, or a list of them with one per optimizer param group; got {value!r}")


# Serialized as what it holds (a float, or a list in JSON): without its own serializer pydantic checks the
# tuple against the union's members and warns on every `Config.to_dict()` (each checkpoint's metadata).
PerGroup = Annotated[Union[float, Tuple[float, ...]], PlainValidator(_per_group_value),
                     PlainSerializer(lambda v: list(v) if isinstance(v, tuple) else v, return_type=Any)]
"""One value (>= 0) for every optimizer param group, or a list with one value per param group."""
PositiveSteps = Annotated[Size, Field(ge=1)]
NonNegativeSteps = Annotated[Size, Field(ge=0)]
WarmupType = Literal["log", "linear"]


class WarmupLRParams(StrictModel):
    """`WarmupLR`: lr = min + (max - min) * g(t) for t < warmup_num_steps, then max.
    g(t) = ln(t + 1) / ln(N) (log) or t / N (linear), N = max(2, warmup_num_steps)."""

    warmup_min_lr: PerGroup = 0.0
    """Learning rate at the start of warmup (the lr of the first optimizer step)."""
    warmup_max_lr: Optional[PerGroup] = None
    """Learning rate reached after warmup. Unset: each param group's own lr from the optimizer
    (DeepSpeed >= 0.17; the older docs say 0.001)."""
    warmup_num_steps: PositiveSteps = 1000
    """Optimizer steps of warmup; values below 2 act as 2 (ln(1) would divide by zero)."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup: "log" or "linear"."""


class WarmupDecayLRParams(WarmupLRParams):
    """`WarmupDecayLR`: WarmupLR, then linear decay to 0 at `total_num_steps`:
    lr = min + (max - min) * max(0, (T - t) / max(1, T - N))."""

    total_num_steps: PositiveSteps
    """Required: optimizer steps of the whole run (warmup included); the lr reaches warmup_min_lr here."""
    warmup_max_lr: PerGroup = 1e-3
    """Learning rate reached after warmup (DeepSpeed's WarmupDecayLR default: 0.001)."""


class WarmupCosineLRParams(StrictModel):
    """`WarmupCosineLR`: a ratio of each param group's own lr (the optimizer's lr when the schedule is
    built). Warmup: ratio = warmup_min_ratio + (1 - warmup_min_ratio) * g(t); then
    ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2), where
    p = min(1, (t - N + 1) / max(1, T - N))."""

    total_num_steps: PositiveSteps
    """Required: optimizer steps of the whole run (warmup included); the ratio reaches cos_min_ratio."""
    warmup_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Ratio of the optimizer's lr at the start of warmup."""
    warmup_num_steps: PositiveSteps = 1000
    """Optimizer steps of warmup; values below 2 act as 2."""
    cos_min_ratio: float = Field(1e-4, ge=0.0, le=1.0)
    """Ratio of the optimizer's lr at the end of the cosine decay."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup: "log" or "linear"."""


class OneCycleParams(StrictModel):
    """`OneCycle` (Smith 2018, arXiv:1803.09820): lr rises from cycle_min_lr to cycle_max_lr over the
    first half-cycle, falls back over the second, then decays as cycle_min_lr / (1 + decay_lr_rate *
    k / decay_step_size). Momentum (beta1 of Adam-style optimizers) moves the opposite way."""

    cycle_min_lr: PerGroup
    """Required: lr at the start and end of the cycle."""
    cycle_max_lr: PerGroup
    """Required: lr at the peak of the cycle."""
    decay_lr_rate: float = Field(0.0, ge=0.0)
    """lr decay rate after the cycle; 0 keeps cycle_min_lr."""
    cycle_first_step_size: PositiveSteps = 2000
    """Optimizer steps of the rising half of the cycle."""
    cycle_second_step_size: Optional[NonNegativeSteps] = None
    """Optimizer steps of the falling half; unset: the same as cycle_first_step_size."""
    cycle_first_stair_count: NonNegativeSteps = 0
    """Stairs in the rising half (lr/momentum held flat between stairs); 0 = continuous."""
    cycle_second_stair_count: Optional[NonNegativeSteps] = None
    """Stairs in the falling half; unset: the same as cycle_first_stair_count."""
    decay_step_size: NonNegativeSteps = 0
    """Optimizer steps per decay interval after the cycle; 0 disables post-cycle decay."""
    cycle_momentum: bool = True
    """Cycle beta1 inversely to the lr. Only for optimizers with `betas` (Adam/AdamW); as in DeepSpeed,
    beta2 is set to 0.99 while cycling, and SGD's momentum is left alone (with a warning)."""
    cycle_min_mom: PerGroup = 0.8
    """beta1 at the peak of the lr cycle."""
    cycle_max_mom: PerGroup = 0.9
    """beta1 at the start and end of the cycle."""
    decay_mom_rate: float = Field(0.0, ge=0.0)
    """beta1 growth rate after the cycle: beta1 = cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)."""


class LRRangeTestParams(StrictModel):
    """`LRRangeTest`: lr = lr_range_test_min_lr * (1 + step_rate * (t + 1) / step_size), the interval
    floored when staircase is on. For finding the largest stable lr, not for training runs."""

    lr_range_test_min_lr: PerGroup = 1e-3
    """lr at the start of the test."""
    lr_range_test_step_size: PositiveSteps = 2000
    """Optimizer steps per lr interval."""
    lr_range_test_step_rate: float = Field(1.0, ge=0.0)
    """lr growth per interval, as a multiple of lr_range_test_min_lr."""
    lr_range_test_staircase: bool = False
    """Hold the lr flat within each interval instead of growing it every step."""


SchedulerParams = Union[WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, OneCycleParams,
                        LRRangeTestParams]

# Canonical type name -> its params model (DeepSpeed's VALID_LR_SCHEDULES).
PARAMS_MODELS: dict[str, type[StrictModel]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}
NOT_BUILT_SCHEDULERS: list[str] = []

# DeepSpeed falls back to torch.optim.lr_scheduler names; say how to use those instead.
_TORCH_SCHEDULERS = ["LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                     "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler",
                     "ReduceLROnPlateau", "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
                     "PolynomialLR"]
_TORCH_HINTS = {name.lower(): f"'{name}' (a torch.optim.lr_scheduler class) is not built yet as a config "
                f"type in dstrain; pass the scheduler object or a callable f(optimizer) as "
                f"initialize(lr_scheduler=...)" for name in _TORCH_SCHEDULERS}


class SchedulerConfig(TypedSection):
    """`scheduler`: the LR schedule the engine builds over its optimizer. A scheduler passed to
    `initialize(lr_scheduler=...)` overrides this section."""

    section: ClassVar[str] = "scheduler"
    params_models: ClassVar[dict[str, type[StrictModel]]] = PARAMS_MODELS
    not_built: ClassVar[list[str]] = NOT_BUILT_SCHEDULERS
    other_hints: ClassVar[dict[str, str]] = _TORCH_HINTS

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest (case-insensitive)."""
    params: SchedulerParams = Field(default_factory=dict)
    """Parameters of `type`; see its params model. Missing keys take DeepSpeed's defaults."""
