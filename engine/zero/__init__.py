"""ZeRO: where parameters, gradients and optimizer state live across data-parallel ranks.

One module per stage behind one interface (`before_backward`, `backward`, `after_backward`, `step`,
`zero_grad`, `state_dict`, `load_state_dict`, `last_grad_norm`): stage 0 is plain data parallelism,
stage 1 partitions optimizer state and fp32 master weights, stage 2 also gradients (`partition.py`
holds the layout they share), stage 3 also parameters (`stage3.py`, docs/zero3.md), with `Init` and
`GatheredParameters` (DeepSpeed's `deepspeed.zero`). `build_zero_optimizer` picks the stage from
`zero_optimization.stage`.
"""
from __future__ import annotations

import schemas
from ops.state_layout import layout_problem, partitioned_state_problem

from ..dist import global_rank
from ..optimizers import is_zero_supported_optimizer
from ..precision import build_guard
from ..utils import tag_parameters
from .per_tensor import attach_per_tensor, closure_problem, per_tensor_problem
from .stage0 import DataParallelOptimizer
from .stage1 import ZeroStage1Optimizer
from .stage2 import ZeroStage2Optimizer
from .tier import PartitionTier
from .grad_swap import attach_grad_swap, swaps_gradients
from .nvme_tier import NvmeOptimizerTier, attach_master_store, inner_factory, wants_nvme
from .param_nvme import attach_param_nvme, finish_param_nvme, refuse_unconsumed_init_chunks, wants_param_nvme
from .init import (GatheredParameters, Init, register_external_parameter,  # noqa: F401  (deepspeed.zero's names)
                   unregister_external_parameter)

PARTITIONED_STAGES = {1: ZeroStage1Optimizer, 2: ZeroStage2Optimizer}


def _partitioned_problems(optimizer, cfg) -> list[str]:
    """Settings stages 1/2 cannot honour, one line each, naming the key."""
    zero, problems = cfg.zero_optimization, []
    from_config = cfg.optimizer is not None and type(optimizer).__name__ == cfg.optimizer.type
    whole_tensors = per_tensor_problem(optimizer, zero.stage, from_config)
    if whole_tensors:  # never applied to chunks, whatever zero_allow_untested_optimizer says
        return [whole_tensors]
    where = f"zero_optimization.stage {zero.stage}"
    no_layout = layout_problem(optimizer, where)
    if no_layout:  # its state is cut into fragments by kind: that must be declared (ops/state_layout.py)
        return [no_layout]
    wrong_state = partitioned_state_problem(inner_factory(optimizer, optimizer.param_groups[0]), where)
    if wrong_state:  # a copy stepped once on a probe: state the declaration does not describe, said now
        return [wrong_state]
    if not is_zero_supported_optimizer(optimizer) and not cfg.zero_allow_untested_optimizer:
        problems.append(f"zero_optimization.stage: {zero.stage} with optimizer {type(optimizer).__name__}, which "
                        "ZeRO has not been tested with (supported: Adam, AdamW, Adagrad, Lion, Lamb, Muon); set "
                        '"zero_allow_untested_optimizer": true to use it anyway')
    # contiguous_gradients and round_robin_gradients are met by construction (schemas/zero.py).
    return problems


def build_zero_optimizer(optimizer, comm, cfg, module=None):
    zero = cfg.zero_optimization
    closure = closure_problem(optimizer, cfg.optimizer is not None and type(optimizer).__name__ == cfg.optimizer.type)
    if closure:
        raise schemas.ConfigError([closure])
    # Global rank 0 says a step was skipped: with pipeline or tensor parallelism several processes
    # are data-parallel rank 0, and each printed it.
    guard = build_guard(cfg, global_rank())
    common = dict(overlap_comm=zero.overlap_comm, grad_accum_dtype=cfg.data_types.grad_accum_dtype,
                  gradient_clipping=cfg.gradient_clipping, prescale_gradients=cfg.prescale_gradients,
                  gradient_predivide_factor=cfg.gradient_predivide_factor,
                  communication_data_type=cfg.communication_data_type,
                  ignore_unused_parameters=zero.ignore_unused_parameters,
                  param_names={p: n for n, p in module.named_parameters()} if module is not None else None)
    if zero.stage == 0:
        zopt = DataParallelOptimizer(optimizer, comm, guard, bucket_numel=zero.reduce_bucket_size, **common)
        tag_parameters(zopt, zopt.params)
        return zopt
    if zero.stage in PARTITIONED_STAGES:
        problems = _partitioned_problems(optimizer, cfg)
        if problems:
            raise schemas.ConfigError(problems)
        zopt = PARTITIONED_STAGES[zero.stage](
            optimizer, comm, guard, reduce_bucket_numel=zero.reduce_bucket_size,
            allgather_bucket_numel=zero.allgather_bucket_size, reduce_scatter=zero.reduce_scatter,
            allgather_partitions=zero.allgather_partitions, tier=PartitionTier.for_zero(comm.device, zero),
            grads_swapped=swaps_gradients(zero, optimizer), **common)
        _attach_tiers(zopt, zero, cfg.aio)
        return zopt
    if zero.stage == 3:
        from .stage3 import ZeroStage3Optimizer  # its unbuilt keys are refused by schemas/unbuilt.py
        problems = _partitioned_problems(optimizer, cfg)
        if problems:
            raise schemas.ConfigError(problems)
        zopt = ZeroStage3Optimizer(optimizer, comm, guard, module, zero, tier=PartitionTier.for_zero(comm.device, zero),
                                   **common)
        _attach_tiers(zopt, zero, cfg.aio)
        return zopt
    raise NotImplementedError(f"zero_optimization.stage: {zero.stage} is not built yet in dstrain")


def _attach_tiers(zopt, zero, aio) -> None:
    """A partitioned optimizer's offload tiers (NVMe parameters at stage 3, the NVMe optimizer at any
    stage), then Lamb's and Muon's per-tensor stepping. A tier that fails takes the swap files of those
    built before it with it: initialize() has no engine yet that destroy() could reach."""
    param_files = zopt.stage == 3 and wants_param_nvme(zero)
    try:
        if zopt.stage == 3:
            refuse_unconsumed_init_chunks(zopt, zero)
        if param_files:  # the partition into swap files (param_nvme.py's note)
            attach_param_nvme(zopt, zero, aio)
        if wants_nvme(zero):  # at stage 3 the fp32 partition is the master too: the same swapped step
            zopt.nvme = NvmeOptimizerTier(zopt, zero, aio)
            attach_grad_swap(zopt)  # the gradient partition in swap files (grad_swap.py's note)
            if not param_files:
                attach_master_store(zopt, zero)  # writes reach the master (partition_store.py: master in the tier)
        if param_files:
            finish_param_nvme(zopt)
        attach_per_tensor(zopt)
    except BaseException:
        release_storage(zopt)
        raise
    tag_parameters(zopt, zopt.params)


def release_storage(zopt) -> None:
    """Delete the swap files of every offload tier `zopt` has (optimizer, parameters, frozen chunks) and
    their directories: `engine.destroy()`, or an `initialize()` that failed after a tier was built."""
    if getattr(zopt, "nvme", None) is not None:
        zopt.nvme.close()
    if hasattr(zopt, "partition"):  # offload_param "nvme": its swap files (partition_store.py)
        zopt.partition.store.close()
    if hasattr(zopt, "frozen_chunks"):  # and the frozen parameters' (stage3_frozen.py)
        zopt.frozen_chunks.close()
