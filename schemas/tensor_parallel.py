"""`tensor_parallel`: DeepSpeed 0.19's AutoTP training section (`TPTrainingConfig`).

Built: `autotp_size` (engine/tensor_parallel/autotp.py shards the model's projections across that many
ranks; the data-parallel group becomes world / autotp_size). The other keys are DeepSpeed's and are
rejected by name until built (schemas/unbuilt.py).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from schemas.base import StrictModel


class TPGroupConfig(StrictModel):
    """`tensor_parallel.tensor_parallel` (alias `tp`): DeepSpeed's inference-style TP settings."""

    tp_size: int = Field(1, ge=1)
    """Ranks to split the model across (DeepSpeed's inference route; training uses autotp_size)."""
    tp_grain_size: int = Field(1, ge=1)
    """Granularity of uneven MLP/LM-head splits."""


class TensorParallelConfig(StrictModel):
    """`tensor_parallel`: automatic tensor parallelism of an unmodified model."""

    autotp_size: int = Field(0, ge=0)
    """Tensor-parallel degree T: each group of T consecutive ranks holds one copy of the model, its
    attention and MLP projections split across them (column-parallel into heads/hidden features,
    row-parallel out of them). 0 or 1: off. World size must divide by T."""
    dtype: Optional[str] = None
    """DeepSpeed converts the model to this dtype; here the precision comes from fp16/bf16."""
    tp_overlap_comm: bool = False
    """Overlap the row-parallel all-reduce with computation."""
    vocab_parallel_lm_head: Optional[bool] = None
    """Shard the LM head (and a tied embedding) by vocabulary. dstrain keeps it whole, which is what None
    and false ask of DeepSpeed for a model outside its HF plan; true is refused."""
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    """The vocab-parallel cross-entropy kernel."""
    tensor_parallel: TPGroupConfig = Field(TPGroupConfig(), alias="tp")
    """DeepSpeed's nested TP settings."""
    injection_policy_tuple: Optional[list[Any]] = None
    """Which modules to shard, given explicitly instead of by name."""
    partition_config: Optional[dict[str, Any]] = None
    """Custom partitioning rules (regex patterns → row/column)."""
    preset_model: Optional[str] = None
    """A built-in partitioning preset for a model family."""
    keep_module_on_host: bool = False
    """Keep loaded checkpoint weights in host memory."""
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Inject DeepSpeed's inference kernels."""
