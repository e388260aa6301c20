"""ZeRO: where parameters, gradients and optimizer state live across data-parallel ranks.

One module per stage behind one interface (`before_backward`, `backward`, `after_backward`, `step`,
`zero_grad`, `state_dict`, `load_state_dict`, `last_grad_norm`): stage 0 is plain data parallelism.
`build_zero_optimizer` picks the stage from `zero_optimization.stage`.
"""
from __future__ import annotations

from ..precision import build_guard
from .stage0 import DataParallelOptimizer


def build_zero_optimizer(optimizer, comm, cfg):
    zero = cfg.zero_optimization
    guard = build_guard(cfg, comm.rank)
    if zero.stage == 0:
        return DataParallelOptimizer(
            optimizer, comm, guard, bucket_numel=zero.reduce_bucket_size, overlap_comm=zero.overlap_comm,
            grad_accum_dtype=cfg.data_types.grad_accum_dtype,
            gradient_clipping=cfg.gradient_clipping, prescale_gradients=cfg.prescale_gradients,
            gradient_predivide_factor=cfg.gradient_predivide_factor,
            communication_data_type=cfg.communication_data_type)
    raise NotImplementedError(f"zero_optimization.stage: {zero.stage} is not built yet in dstrain")
