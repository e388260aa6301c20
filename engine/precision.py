"""Mixed precision: the loss scaler and the policy for non-finite gradients.

Master weights live in the ZeRO optimizer of each stage (full copies at stage 0, partitions above);
what every stage shares is here:
- `LossScaler`: DeepSpeed's static or dynamic fp16 loss scale (hysteresis, window growth, minimum).
- `NonFiniteGuard`: decides from the global gradient norm whether a step is applied, updates the
  scaler, counts consecutive skips, logs one line per skip, and raises where the policy says so.
[Note: one agreement, no extra sync] The guard reads one scalar: the global norm. It is computed
over gradients that are already reduced (stage 0) or all-reduced as a sum of squares (ZeRO 1/2/3),
so an Inf/NaN on any rank makes the norm non-finite on every rank, and all ranks skip the same step
without a separate flag all-reduce and without syncing each tensor to the host.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LossScaleAtMinimum(RuntimeError):
    pass


class LossScaler:
    """DeepSpeed's loss scaler. Static when `dynamic` is False (scale never changes).

    Dynamic rule (runtime/fp16/loss_scaler.py): on an overflow, if the hysteresis budget is spent
    (hysteresis == 1 or cur_hysteresis == 1) the scale halves, not below `min_scale` (an overflow at
    the minimum is an error); otherwise the budget shrinks by one. On a clean step the budget is
    refilled when `consecutive_hysteresis`, and every `scale_window` steps since the last overflow the
    scale doubles (refilling the budget too).
    """

    def __init__(self, init_scale: float = 1.0, dynamic: bool = False, scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_scale: float = 1.0,
                 scale_factor: float = 2.0):
        self.cur_scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = scale_factor
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        if not fp16.enabled:
            return cls(1.0, dynamic=False)
        if fp16.loss_scale > 0:
            return cls(fp16.loss_scale, dynamic=False)
        return cls(2.0 ** fp16.initial_scale_power, dynamic=True, scale_window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            self._update_dynamic(overflow)
        self.cur_iter += 1

    def _update_dynamic(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale:
                    raise LossScaleAtMinimum(
                        f"fp16 gradients overflowed with the loss scale already at min_loss_scale="
                        f"{self.min_scale:g}; the model produces Inf/NaN gradients. Lower the learning "
                        "rate, check the data, or train in bf16")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            return
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("cur_scale", "dynamic", "scale_window", "delayed_shift",
                                              "cur_hysteresis", "consecutive_hysteresis", "min_scale",
                                              "scale_factor", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class NonFiniteGuard:
    """Applies the NaN/Inf policy at each boundary step (see the module note)."""

    scaler: LossScaler
    precision: str  # "fp16" | "bf16" | "fp32"
    nan_policy: str = "skip"
    max_consecutive_skips: int = 100
    rank: int = 0
    consecutive_skips: int = 0
    total_skips: int = 0

    def check(self, global_norm: float, step: int) -> bool:
        """True when the step may be applied. Updates the scaler either way."""
        finite = math.isfinite(global_norm)
        if finite:
            self.scaler.update(False)
            self.consecutive_skips = 0
            return True
        self.total_skips += 1
        self.consecutive_skips += 1
        if self.precision != "fp16" and self.nan_policy == "raise":
            raise FloatingPointError(f"step {step}: non-finite gradient norm ({global_norm}) in {self.precision}; "
                                     "fault_tolerance.nan_policy is 'raise'")
        old = self.scaler.loss_scale
        try:
            self.scaler.update(True)
        except LossScaleAtMinimum as e:
            raise LossScaleAtMinimum(f"step {step}: {e}") from None
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise FloatingPointError(f"step {step}: {self.consecutive_skips} consecutive steps skipped for non-finite "
                                     "gradients (fault_tolerance.max_consecutive_skips); stopping")
        if self.rank == 0:
            what = (f"fp16 gradient overflow; loss scale {old:g} -> {self.scaler.loss_scale:g}"
                    if self.precision == "fp16" else f"non-finite gradient norm in {self.precision}")
            print(f"[dstrain] step {step}: {what}; step skipped "
                  f"({self.consecutive_skips} in a row, {self.total_skips} in total)", flush=True)
        return False

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "consecutive_skips": self.consecutive_skips,
                "total_skips": self.total_skips}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.consecutive_skips = state["consecutive_skips"]
        self.total_skips = state["total_skips"]


def model_dtype(cfg) -> torch.dtype:
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def slow_cpu_fp16_warning(cfg, device: torch.device) -> str | None:
    """The warning for fp16 weights on a CPU whose oneDNN has no fp16 matmul, else None.

    [Note: fp16 on CPU] Without oneDNN's fp16 kernels (CPUs before AVX512-FP16/AMX-FP16) torch runs an
    fp16 matmul through its scalar fallback: about 200x slower than fp32 on this project's machines
    (a 1024x512 @ 512x2048 matmul, one thread: 2.3 s against 11 ms), so a 25M GPT's fp16 step took
    62 s where fp32 took 2.4 s. DeepSpeed refuses fp16 on CPU; dstrain runs it (the math is the same
    as on a GPU, which is what the tests need) and says what it will cost."""
    if not cfg.fp16.enabled or device.type != "cpu":
        return None
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    mkldnn = torch.backends.mkldnn
    if mkldnn.is_available() and mkldnn.enabled and supported is not None and supported():
        return None
    return ("fp16.enabled: no oneDNN fp16 matmul here (this CPU lacks it, or torch.backends.mkldnn is "
            "off), so every fp16 matmul runs torch's scalar fallback (about 200x slower than fp32); "
            "use bf16.enabled on CPU, or fp16 on a GPU")


def warn_if_slow_cpu_fp16(cfg, device: torch.device, rank: int) -> None:
    message = slow_cpu_fp16_warning(cfg, device)
    if message is not None and rank == 0:  # one line per job (the global rank), not per rank
        warnings.warn(message, stacklevel=3)


def precision_name(cfg) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def build_guard(cfg, rank: int) -> NonFiniteGuard:
    return NonFiniteGuard(LossScaler.from_config(cfg.fp16), precision_name(cfg),
                          cfg.fault_tolerance.nan_policy, cfg.fault_tolerance.max_consecutive_skips, rank)
