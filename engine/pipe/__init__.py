"""Pipeline parallelism (DeepSpeed's `deepspeed.pipe`): a model written as a list of layers, split
into stages, run by one of torch's schedules (`torch.distributed.pipelining`).

- `PipelineModule`, `LayerSpec`, `TiedLayerSpec` (module.py); partitioning (partition.py);
- `PipelineEngine.train_batch` / `eval_batch` (engine.py), what crosses a stage (boundary.py), the
  once-per-step reduction and the world-wide gradient norm (reduction.py); what every rank agrees on
  before a batch runs: an iterator that ran out raises `DataExhausted` on all (batch_agreement.py);
  user code that raised inside the schedule on one stage raises `StageFailed` on all others (stage_failure.py);
- `pipeline.schedule` and bubble accounting (schedule.py), the bubble measured in wall-clock time
  (stage_clock.py); `pipeline.pipe_partitioned` / `grad_partitioned` (partitioned_wire.py). See
  docs/parallelism.md.
"""
from .batch_agreement import DataExhausted, DataReadFailed
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .stage_failure import StageFailed

__all__ = ["DataExhausted", "DataReadFailed", "LayerSpec", "PipelineModule", "StageFailed", "TiedLayerSpec"]
