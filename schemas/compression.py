"""`gradient_compression` (dstrain's own section): compressed gradient all-reduce."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import StrictModel


class GradientCompressionConfig(StrictModel):
    """`gradient_compression`: low-rank gradient compression for data parallelism."""

    type: Literal["powersgd"] = "powersgd"
    """dstrain: compression algorithm; "powersgd" (Vogels et al., 2019) is the only one."""
    rank: int = Field(4, ge=1)
    """dstrain: PowerSGD approximation rank; higher is more accurate and sends more bytes."""
    start_step: int = Field(100, ge=0)
    """dstrain: optimizer steps of uncompressed all-reduce before compression starts."""
