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
    """`zero_optimization.offload_param`: where ZeRO-3 keeps partitioned parameters (README, Offload)."""

    device: OffloadDevice = "none"
    """Where the stage-3 parameter partitions live between uses: "none" (the accelerator), "cpu" (host
    memory; the prefetcher copies each chunk to the accelerator when it gathers) or "nvme" (swap files
    under `nvme_path`, read ahead of each gather through a buffer pool: engine/zero/param_nvme.py,
    offload/param_swap.py). Stage 3 only."""
    nvme_path: Optional[str] = None
    """Directory on the NVMe device for parameter swap files (device "nvme"; a per-job directory is
    made in it and removed at exit)."""
    buffer_count: int = Field(5, ge=1)
    """Buffers in the pool parameter slots are read into ahead of their gathers (device "nvme"); the
    prefetcher reads up to this many groups ahead. At least 1: every gather reads through one."""
    buffer_size: Size = Field(100_000_000, ge=0)
    """Elements per parameter swap buffer (device "nvme"): at least the elements of one module's gather
    group on a rank (refused with the needed size when smaller); buffers are allocated only as large as
    the largest group needs."""
    max_in_cpu: Size = Field(1_000_000_000, ge=0)
    """Parameter elements kept resident in host memory once read (device "nvme"): groups read while
    the count fits stay in memory, the rest are read from the files at every gather."""
    pin_memory: bool = True
    """Page-locked host memory for offloaded parameters when an accelerator is present (faster, async
    copies; more locked RAM: set false where `ulimit -l` is tight). True by default as in DeepSpeed
    0.19.5+. Nothing to pin on a CPU-only machine."""


class OffloadOptimizerConfig(StrictModel):
    """`zero_optimization.offload_optimizer`: where optimizer state lives and the step runs (README, Offload)."""

    device: OffloadDevice = "none"
    """Where the fp32 master weights, optimizer state and gradient partitions live: "none" (the
    accelerator) or "cpu" (host memory; the step runs there with torch's fused CPU kernel). Stages 1-3;
    "nvme" (master weights and state in swap files under nvme_path, engine/zero/nvme_tier.py): stages 1-3."""
    nvme_path: Optional[str] = None
    """Directory on the NVMe device for optimizer-state swap files (device "nvme"; a per-job directory is
    made in it and removed at exit)."""
    buffer_count: int = Field(4, ge=1)
    """Swap buffers of one sub-group each (device "nvme"): at least the tensors swapped per sub-group
    (AdamW: master, exp_avg, exp_avg_sq = 3; fewer is refused at initialize, naming the number needed);
    3x that for full pipelining."""
    pin_memory: bool = True
    """Page-locked host memory for the offloaded partitions when an accelerator is present, so gradient
    and weight copies are asynchronous. True by default as in DeepSpeed 0.19.5+; set false where
    `ulimit -l` is tight. Nothing to pin on a CPU-only machine."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group from NVMe with the current sub-group's step (device "nvme")."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group to NVMe with the current sub-group's step (device "nvme")."""
    fast_init: bool = False
    """Device "nvme": write no swap file at initialisation; the first step reads the initial master
    weights from host memory and writes master and state for the first time (DeepSpeed's fast_init
    batches that initial write; here it is skipped). Same training, bit for bit."""
    swap_slots: int = Field(2, ge=1, le=2)
    """Device "nvme" (a dstrain key): copies of the optimizer-state swap files. 2: a step writes the
    other copy and switches to it only when every write has finished, so a step that fails halfway
    (disk full, an I/O error) leaves the previous state bit for bit; twice the disk. 1: in place, as
    DeepSpeed's swapper writes: half the disk, the same training; after a failed step the state is
    refused (an error naming the file) until a checkpoint is loaded."""
    swap_gradients: Optional[bool] = None
    """Device "nvme" (a dstrain key): keep the fp32 gradient partition in swap files beside the state
    (true: host memory for it is the landings in flight, whatever the model size; a write and one or two
    reads of 4 bytes per partition element each step) or in host memory (false: 4 bytes per partition element,
    where DeepSpeed keeps it). Unset: true when `offload_param.device` is "nvme" too and the rank's
    parameter partition is larger than `offload_param.max_in_cpu` (ZeRO-Infinity, where host memory is
    the limit), false otherwise (engine/zero/grad_swap.py)."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer state offloaded; below 1 only with ZeRO stage 3 (not built yet: only 1)."""
    super_offload: bool = False
    """DeepSpeed's Superchip offload path (stage 3) (not built yet)."""
    convert_grad_on_cpu: bool = True
    """With an accelerator: copy each reduced gradient segment to the host in its wire dtype and widen it
    to fp32 there (true: half the bytes over PCIe for 16-bit wires), or widen it on the accelerator first
    (false). The values are the same either way (the cast is exact)."""
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores the CPU optimizer may use (super_offload only) (not built yet)."""


class ZeroConfig(StrictModel):
    """`zero_optimization`: ZeRO partitioning of optimizer state, gradients and parameters."""

    stage: int = Field(0, ge=0, le=3)
    """0 data parallel, 1 optimizer states, 2 + gradients, 3 + parameters partitioned."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as backward produces them. By construction: at
    stages 1-3 dstrain always reduces gradients into contiguous flat partitions (DESIGN decision 2),
    so either value gives the same result and the same memory bound; at stage 0, false is rejected
    (the key applies to stages 1-3 only)."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce (stage 2)."""
    reduce_bucket_size: Size = Field(500_000_000, ge=0)
    """Elements reduced per bucket (gradient all-reduce / reduce-scatter)."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the reduce buckets of all ranks into one all-reduce. By construction: dstrain issues one
    collective per bucket for all ranks at every stage; either value gives the same result."""
    allgather_partitions: bool = True
    """Stages 1/2: gather updated partitions with all-gather (true) or a series of broadcasts (false).
    Stage 3 always all-gathers: false is not built yet there and is rejected."""
    allgather_bucket_size: Size = Field(500_000_000, ge=0)
    """Elements all-gathered per bucket."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward; unset means true for stage 3, else false."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the checkpoint's fp32 copy rather than the 16-bit model. dstrain
    always does (engine/checkpoint/restore.py); false is not built yet and is rejected."""
    elastic_checkpoint: bool = False
    """Legacy elastic checkpoints for stages 1 and 2. By construction: every dstrain checkpoint loads
    at any world size and stage (DESIGN decision 4), which is what true asks for; false takes nothing
    away that a run relies on."""
    offload_param: Optional[OffloadParamConfig] = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer-state offload (CPU and NVMe: stages 1-3)."""
    zenflow: Optional[dict[str, Any]] = None
    """DeepSpeed's ZenFlow (stall-free offload) options (not built yet: the section is rejected)."""
    leaf_module: Optional[dict[str, Any]] = None
    """Stage 3: modules DeepSpeed treats as ZeRO-3 leaf modules (not built yet: the section is rejected;
    dstrain's units are chosen as docs/zero3.md says)."""
    sub_group_size: Size = Field(1_000_000_000, ge=0)
    """Elements per optimizer sub-group stepped (and swapped) at a time; read by NVMe optimizer offload
    at stages 1-3 (rounded up to a multiple of 64, engine/zero/nvme_tier.py), refused elsewhere."""
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
    """Stage 3: fetch fine-grained modules (below this granularity) as one unit (not built yet: only 0)."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Stage 3: fetch parameters with all-reduce instead of all-gather (not built yet: true rejected)."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Stage 3: gather parameters one by one instead of through buckets (not built yet: true rejected)."""
    ignore_unused_parameters: bool = True
    """Every stage: true counts a trainable parameter that got no gradient in a step as a zero gradient
    (as DDP does); false makes it an error at `step()` that names the parameters (DeepSpeed's check)."""
    legacy_stage1: bool = False
    """DeepSpeed's removed legacy stage-1 implementation (not supported: true is rejected)."""
    round_robin_gradients: bool = False
    """Stages 1/2 with CPU offload: spread gradient copies across ranks. By construction: an ordering
    of the copies into the offloaded buffer with the same result; dstrain's copies (engine/zero/tier.py)
    land in the fixed bucket order whatever the value; either value is accepted at stages 1-3 (true
    is rejected at stage 0, where it means nothing)."""
    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ hpZ: ranks in the secondary parameter partition group (not built yet: above 1 rejected)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: quantise weights for all-gather (not built yet: true rejected)."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: store frozen weights quantised (not built yet: true rejected)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: quantise gradients for reduce-scatter (not built yet: true rejected)."""
    zeropp_loco_param: Optional[dict[str, Any]] = None
    """ZeRO++ LoCo error-feedback parameters (err_beta, reset_T) (not built yet: rejected)."""
    mics_shard_size: int = -1
    """MiCS: ranks per parameter shard group; -1 off (not built yet: other values rejected)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: gather parameters hierarchically (not built yet: true rejected)."""
    memory_efficient_linear: bool = True
    """Stage 3: a linear layer that keeps no gathered weight alive between forward and backward. By
    construction: dstrain's stage 3 frees every gathered weight's storage after forward, and the views
    autograd saved see it re-gathered in backward (docs/zero3.md, Storage), for every layer; either
    value gives that result."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints in pipeline mode (not built yet: true rejected)."""
    override_module_apply: bool = True
    """Stage 3: gather parameters around nn.Module.apply, as engine.zero.Init always does (false is not
    built yet and is rejected)."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log trace-cache invalidation warnings (not built yet: true rejected)."""
    enable_sanity_checks: bool = False
    """Run internal consistency checks (debugging) (not built yet: true rejected)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_overlap_comm(cls, data: Any) -> Any:
        # DeepSpeed's overlap_comm default depends on the stage (true only for stage 3); resolving it
        # here lets the frozen model expose a plain bool.
        if isinstance(data, dict) and data.get("overlap_comm") in (None, "auto"):
            data = {k: v for k, v in data.items() if k != "overlap_comm"}
            data["overlap_comm"] = data.get("stage", 0) == 3
        return data
