"""Mixed-precision sections: `fp16`, `bf16` (alias `bfloat16`), `data_types`, `amp`.

Defaults are DeepSpeed 0.19.8's (`runtime/precision_config.py`, `runtime/constants.py`). Cross-field
rules (fp16 and bf16 both on, min_loss_scale above the initial scale) live in `schemas/checks.py`.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from schemas.base import StrictModel


class FP16Config(StrictModel):
    """`fp16`: fp16 mixed precision with a loss scaler (static or dynamic)."""

    enabled: bool = False
    """Train with fp16 model weights, fp32 master weights and loss scaling."""
    auto_cast: bool = False
    """Cast the module's floating-point inputs to fp16 in forward."""
    loss_scale: float = Field(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=64)
    """Dynamic scaling starts at a loss scale of 2**initial_scale_power."""
    loss_scale_window: int = Field(1000, ge=1)
    """Overflow-free steps after which the dynamic loss scale is doubled."""
    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the dynamic loss scale is halved (DeepSpeed's delayed_shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step."""
    min_loss_scale: float = Field(1.0, gt=0.0)
    """The dynamic loss scale never drops below this value."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (DeepSpeed: ZeRO-2 with CPU Adam only). Not built yet:
    true is rejected; dstrain keeps them in fp32."""

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic (loss_scale == 0)."""
        return self.loss_scale == 0.0


class BF16Config(StrictModel):
    """`bf16` (alias `bfloat16`): bf16 mixed precision, no loss scaling."""

    enabled: bool = False
    """Train with bf16 model weights and fp32 master weights."""
    immediate_grad_update: bool = False
    """Accumulate each gradient into its fp32 buffer as soon as backward produces it. Not built yet:
    true is rejected."""
    check_grad_overflow: bool = True
    """Check gradients for inf/NaN and skip the step as fp16 does (default true since DeepSpeed 0.19.3).
    dstrain always checks (`fault_tolerance.nan_policy` says what a non-finite gradient does); false
    is not built yet and is rejected."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in bf16 inside the ZeRO optimizer. Not built yet: true is
    rejected; dstrain keeps them in fp32."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (needs bf16_master_weights_and_grads). Not built yet: true is
    rejected."""


class DataTypesConfig(StrictModel):
    """`data_types`: dtypes of intermediate buffers."""

    grad_accum_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None
    """Dtype gradients are accumulated in; None means the model's dtype."""


class AmpConfig(StrictModel):
    """`amp`: NVIDIA Apex AMP. dstrain never supports it; use fp16 or bf16."""

    model_config = StrictModel.model_config | {"extra": "allow"}
    # [Note] DeepSpeed passes every other key straight to apex.amp.initialize, so they are opaque here.

    enabled: bool = False
    """Enable Apex AMP (rejected in dstrain: use fp16 or bf16)."""
