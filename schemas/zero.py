"""`zero_optimization` with its `offload_param` and `offload_optimizer` sub-sections.

Field names and defaults follow DeepSpeed 0.19.8 (`runtime/zero/config.py`, `offload_config.py`),
including its naming of the stage-3 keys: the attribute is `prefetch_bucket_size` and the config key
may be written `stage3_prefetch_bucket_size` (the alias) or the short name. Deprecated keys
(`cpu_offload`, `cpu_offload_param`, `cpu_offload_use_pin_memory`,
`stage3_gather_fp16_weights_on_model_save`, the boolean form) are mapped in `schemas/deprecated.py`
before these models see the dict.
"""
from __future__ import annotations

import sys
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from schemas.base import Size, StrictModel

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadParamConfig(StrictModel):
    """`zero_optimization.offload_param`: where ZeRO-3 keeps partitioned parameters."""

    device: OffloadDevice = "none"
    """Where parameters live between uses: "none" (accelerator), "cpu" or "nvme"."""
    nvme_path: Optional[str] = None
    """Directory on the NVMe device for parameter swap files (required with device "nvme")."""
    buffer_count: int = Field(5, ge=0)
    """Buffers in the pool used to swap parameters from NVMe."""
    buffer_size: Size = Field(100_000_000, ge=0)
    """Elements per NVMe parameter swap buffer."""
    max_in_cpu: Size = Field(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when offloading to NVMe."""
    pin_memory: bool = False
    """Use page-locked CPU memory for offloaded parameters (faster copies, more RAM)."""


class OffloadOptimizerConfig(StrictModel):
    """`zero_optimization.offload_optimizer`: where optimizer state lives and the step runs."""

    device: OffloadDevice = "none"
    """Where optimizer state lives: "none" (accelerator), "cpu" or "nvme"; the step runs on CPU."""
    nvme_path: Optional[str] = None
    """Directory on the NVMe device for optimizer-state swap files (required with device "nvme")."""
    buffer_count: int = Field(4, ge=0)
    """Swap buffers; at least the states per parameter (Adam: param, grad, m, v = 4)."""
    pin_memory: bool = False
    """Use page-locked CPU memory for offloaded optimizer state."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group from NVMe with the current sub-group's step."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group to NVMe with the current sub-group's step."""
    fast_init: bool = False
    """Initialise NVMe-offloaded optimizer state quickly."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer state offloaded; below 1 only with ZeRO stage 3."""
    super_offload: bool = False
    """DeepSpeed's Superchip offload path (stage 3)."""
    convert_grad_on_cpu: bool = True
    """Convert gradients to fp32 on CPU rather than on the accelerator."""
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores the CPU optimizer may use (super_offload only)."""


class ZeroConfig(StrictModel):
    """`zero_optimization`: ZeRO partitioning of optimizer state, gradients and parameters."""

    stage: int = Field(0, ge=0, le=3)
    """0 data parallel, 1 optimizer states, 2 + gradients, 3 + parameters partitioned."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as backward produces them."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce (stage 2)."""
    reduce_bucket_size: Size = Field(500_000_000, ge=0)
    """Elements reduced per bucket (gradient all-reduce / reduce-scatter)."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the reduce buckets of all ranks into one all-reduce."""
    allgather_partitions: bool = True
    """Gather updated partitions with all-gather (true) or a series of broadcasts (false)."""
    allgather_bucket_size: Size = Field(500_000_000, ge=0)
    """Elements all-gathered per bucket."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward; unset means true for stage 3, else false."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the checkpoint's fp32 copy rather than the 16-bit model."""
    elastic_checkpoint: bool = False
    """Legacy elastic checkpoints for stages 1 and 2."""
    offload_param: Optional[OffloadParamConfig] = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer-state offload (CPU: stages 1-3; NVMe: stage 3)."""
    sub_group_size: Size = Field(1_000_000_000, ge=0)
    """Elements per optimizer sub-group stepped (and swapped) at a time."""
    prefetch_bucket_size: Size = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: parameter elements fetched ahead of use."""
    param_persistence_threshold: Size = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters smaller than this many elements stay unpartitioned."""
    model_persistence_threshold: Size = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    """Stage 3: cap on the total elements kept unpartitioned by param_persistence_threshold."""
    max_live_parameters: Size = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    """Stage 3: parameter elements resident per rank before gathered ones are released."""
    max_reuse_distance: Size = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a gathered parameter if it is reused within this many elements."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: gather full 16-bit weights for save_16bit_model()."""
    module_granularity_threshold: Size = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    """Stage 3: fetch fine-grained modules (below this granularity) as one unit."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Stage 3: fetch parameters with all-reduce instead of all-gather."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Stage 3: gather parameters one by one instead of through buckets."""
    ignore_unused_parameters: bool = True
    """Every stage: true counts a trainable parameter that got no gradient in a step as a zero gradient
    (as DDP does); false makes it an error at `step()` that names the parameters (DeepSpeed's check)."""
    legacy_stage1: bool = False
    """DeepSpeed's removed legacy stage-1 implementation."""
    round_robin_gradients: bool = False
    """Stages 1/2 with CPU offload: spread gradient copies across ranks."""
    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ hpZ: ranks in the secondary parameter partition group."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: quantise weights for all-gather."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: store frozen weights quantised."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: quantise gradients for reduce-scatter."""
    zeropp_loco_param: Optional[dict[str, Any]] = None
    """ZeRO++ LoCo error-feedback parameters (err_beta, reset_T)."""
    mics_shard_size: int = -1
    """MiCS: ranks per parameter shard group; -1 off."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: gather parameters hierarchically."""
    memory_efficient_linear: bool = True
    """Stage 3: memory-efficient linear layer."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints in pipeline mode."""
    override_module_apply: bool = True
    """Stage 3: gather parameters around nn.Module.apply."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log trace-cache invalidation warnings."""
    enable_sanity_checks: bool = False
    """Run internal consistency checks (debugging)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_overlap_comm(cls, data: Any) -> Any:
        # DeepSpeed's overlap_comm default depends on the stage (true only for stage 3); resolving it
        # here lets the frozen model expose a plain bool.
        if isinstance(data, dict) and data.get("overlap_comm") in (None, "auto"):
            data = {k: v for k, v in data.items() if k != "overlap_comm"}
            data["overlap_comm"] = data.get("stage", 0) == 3
        return data
