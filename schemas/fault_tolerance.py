"""`fault_tolerance` (dstrain's own section): what a non-finite gradient does to a run."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import StrictModel


class FaultToleranceConfig(StrictModel):
    """`fault_tolerance`: the NaN/Inf policy that applies to every precision."""

    nan_policy: Literal["skip", "raise"] = "skip"
    """dstrain: on a NaN/Inf gradient, "skip" the step (counted in skipped_steps) or "raise" an error."""
    max_consecutive_skips: int = Field(100, ge=1)
    """dstrain: raise an error after this many consecutive skipped steps, whatever nan_policy says."""
