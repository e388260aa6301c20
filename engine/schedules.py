"""DeepSpeed's LR schedules with DeepSpeed's exact semantics: WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle, LRRangeTest. `build_scheduler` makes one from a `SchedulerConfig`; `resolve_scheduler` also
accepts a user's scheduler object or a callable `f(optimizer)`, as `initialize(lr_scheduler=...)` does.

[Note: step counting] `last_batch_iteration` (t) is the index of the last optimizer step taken; it
starts at -1. Construction (with t = -1) writes the schedule's starting lr into the optimizer, and each
`step()` advances t by one and writes lr(t), which the *next* optimizer step uses. So the first
optimizer step runs with the constructor's lr, the second with lr(0), and so on. The engine calls
`step()` once per applied optimizer step and not on skipped (overflow) steps.

[Note: resume] `state_dict()` is DeepSpeed's `{'last_batch_iteration': t}` (WarmupCosineLR adds the
base lrs it scales). Unlike DeepSpeed, `load_state_dict()` also writes lr(t) into the optimizer, so a
resumed run continues the sequence even when optimizer states were not loaded.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence, Union

import torch

from schemas.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

PerGroup = Union[float, Sequence[float]]


def _torch_optimizer(optimizer: Any) -> Any:
    """The object whose `param_groups` the schedule writes: a torch optimizer, or the one a wrapper holds."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and has no param_groups")


def _per_group(value: PerGroup, groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: got {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _write_lrs(param_groups: list[dict], lrs: list[float]) -> list[float]:
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # tensor lrs (capturable/compiled optimizers) stay tensors
        else:
            group["lr"] = lr
    return [float(group["lr"]) for group in param_groups]


def _warmup_fraction(t: int, warmup_num_steps: int, warmup_type: str) -> float:
    """g(t) in [0, 1): ln(t + 1) / ln(N) for "log", t / N for "linear" (t < N)."""
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_num_steps)
    return t / warmup_num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return max(2, warmup_num_steps)  # ln(1) = 0 would divide by zero in the log warmup


class LRSchedule:
    """The surface every dstrain schedule has (DeepSpeed's): `step`, `get_lr`, `get_last_lr`,
    `state_dict`, `load_state_dict`. Subclasses implement `get_lr()` for the current t."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1):
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [float(g["lr"]) for g in self.optimizer.param_groups]

    def _start(self) -> None:
        """Called at the end of a subclass's __init__: a fresh schedule writes its starting lr."""
        if self.last_batch_iteration == -1:
            self._apply()

    def _apply(self) -> None:
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        """The lr of every param group at the current `last_batch_iteration`."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lr last written into the optimizer, one per param group."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


class WarmupLR(LRSchedule):
    """lr = min + (max - min) * g(t) during warmup, then max. Before the first step: min."""

    def __init__(self, optimizer: Any, warmup_min_lr: PerGroup = 0.0, warmup_max_lr: Optional[PerGroup] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:  # DeepSpeed >= 0.17: warm up to each group's own lr
            warmup_max_lr = [float(g["lr"]) for g in groups]
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self._start()

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type) if t < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay: gamma = max(0, (T - t) / max(1, T - N)), reaching min at t = T."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 1e-3, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        t, n = self.last_batch_iteration, self.warmup_num_steps
        if t < n:
            return _warmup_fraction(t, n, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - n))


class WarmupCosineLR(LRSchedule):
    """A ratio of each group's own lr (read when the schedule is built): warmup from warmup_min_ratio
    to 1, then a cosine down to cos_min_ratio at t = T - 1, held there. Before the first step: 0."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        t, n = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < n:
            fraction = _warmup_fraction(t, n, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        # Progress is clamped at 1 so the ratio stays at the floor past total_num_steps (DeepSpeed 0.19).
        progress = min(1.0, (t - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.org_lrs = list(state.get("org_lrs", self.org_lrs))  # DeepSpeed's state has no org_lrs
        super().load_state_dict(state)


class OneCycle(LRSchedule):
    """One triangular lr cycle, cycle_min_lr -> cycle_max_lr -> cycle_min_lr, then an optional decay;
    beta1 cycles the opposite way between cycle_max_mom and cycle_min_mom.

    With k = t + 1 (steps into the cycle) and S1, S2 the half-cycle lengths, the scale is k / S1 while
    rising and (S1 + S2 - k) / S2 while falling; a stair count n > 0 floors the scale to multiples of
    1 / n. After the cycle (t >= S1 + S2), with d = t - (S1 + S2) + 1:
    lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size), beta1 = cycle_max_mom * (1 +
    decay_mom_rate * d / decay_step_size). Before the first step: cycle_min_lr and cycle_min_mom.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        if cycle_first_step_size <= 0 or (cycle_second_step_size or 0) < 0:
            raise ValueError("cycle_first_step_size must be > 0 and cycle_second_step_size >= 0")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and self._has_betas()
        self.min_moms = _per_group(cycle_min_mom, groups, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, groups, "cycle_max_mom")
        self._start()

    def _has_betas(self) -> bool:
        defaults = getattr(self.optimizer, "defaults", {})
        if "betas" not in defaults:
            logger.warning("OneCycle: cycle_momentum is off because %s has no 'betas' (DeepSpeed cycles "
                           "only Adam-style beta1)", type(self.optimizer).__name__)
            return False
        return True

    def _scale(self) -> float:
        k = self.last_batch_iteration + 1
        position = k % self.total_size  # steps into the current cycle
        if position <= self.first_step_size:
            scale, stairs = position / self.first_step_size, self.first_stair_count
            stair_position = position * stairs / self.first_step_size if stairs else 0.0
        else:
            scale, stairs = (self.total_size - position) / self.second_step_size, self.second_stair_count
            stair_position = (self.total_size - position) * stairs / self.second_step_size if stairs else 0.0
        if stairs > 0:
            # Quantise from the integer offset, not from `scale`: a float scale a hair below a stair
            # would otherwise drop a whole stair (DeepSpeed 0.19 does the same).
            scale = math.floor(stair_position) / stairs
        return scale

    def _decay_steps(self) -> Optional[float]:
        """d / decay_step_size after the cycle; None inside the cycle."""
        if self.last_batch_iteration < self.total_size:
            return None
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size if self.decay_step_size else 0.0

    def get_lr(self) -> list[float]:
        decay = self._decay_steps()
        if decay is None:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        return [lo / (1.0 + self.decay_lr_rate * decay) for lo in self.min_lrs]

    def get_mom(self) -> Optional[list[float]]:
        """beta1 of every param group at the current t; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        decay = self._decay_steps()
        if decay is None:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        return [hi * (1.0 + self.decay_mom_rate * decay) for hi in self.max_moms]

    def _apply(self) -> None:
        if self.last_batch_iteration == -1:  # a fresh schedule starts at the bottom of the cycle
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.min_lrs)
            moms = self.min_moms if self.cycle_momentum else None
        else:
            super()._apply()
            moms = self.get_mom()
        for group, beta1 in zip(self.optimizer.param_groups, moms or []):
            group["betas"] = (beta1, 0.99)  # DeepSpeed pins beta2 to 0.99 while cycling


class LRRangeTest(LRSchedule):
    """lr = lr_range_test_min_lr * (1 + step_rate * interval), interval = (t + 1) / step_size, floored
    when staircase is on. Before the first step: lr_range_test_min_lr."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: PerGroup = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(lr_range_test_min_lr, len(self.optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest,
}


def build_scheduler(optimizer: Any, cfg: SchedulerConfig) -> LRSchedule:
    """The schedule `cfg` describes, over `optimizer` (a torch optimizer or a wrapper holding one).
    Building it writes the schedule's starting lr into the optimizer."""
    return SCHEDULES[cfg.type](optimizer, **cfg.params.model_dump())


def resolve_scheduler(lr_scheduler: Any, optimizer: Any, cfg: Optional[SchedulerConfig]) -> Any:
    """What `initialize(lr_scheduler=...)` ends up with, as DeepSpeed decides it.

    A scheduler object is used as is; a callable is called as `lr_scheduler(optimizer)`; with neither,
    the config's `scheduler` section is built, or None when there is none. A passed-in scheduler
    overrides the config section.
    """
    if lr_scheduler is None:
        if cfg is None:
            return None
        if optimizer is None:
            raise ValueError("the config has a 'scheduler' section but there is no optimizer to schedule; "
                             "add an 'optimizer' section or pass initialize(optimizer=...)")
        return build_scheduler(optimizer, cfg)
    if cfg is not None:
        logger.warning("initialize(lr_scheduler=...) overrides the config's 'scheduler' section (%s)", cfg.type)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    if not hasattr(lr_scheduler, "step"):
        raise TypeError(f"lr_scheduler must be a scheduler with step() or a callable f(optimizer), "
                        f"got {type(lr_scheduler).__name__}")
    return lr_scheduler
