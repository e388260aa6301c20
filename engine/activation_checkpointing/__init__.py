"""Activation checkpointing — `engine.checkpointing`, DeepSpeed's `deepspeed.checkpointing` (not the
save/load of training state: that is `engine/checkpoint/`, the engine's `checkpoint_io`).

- `checkpoint(fn, *args)`: reentrant, as DeepSpeed's and Megatron's (each region records the parameters
  it uses for ZeRO's first backward: `region_params.py`); `non_reentrant_checkpoint`.
- `configure(mpu_, deepspeed_config, partition_activations, ..., checkpoint_in_cpu, synchronize,
  profile)`, `is_configured()`, `reset()` (DeepSpeed's: the contiguous buffers let go), `unconfigure()`;
  `initialize()` configures from the config section itself.
- `get_cuda_rng_tracker()`, `model_parallel_cuda_manual_seed(seed)`: named RNG streams, replayed in
  recomputes.
- `checkpoint_blocks(model, section)`: checkpoint every repeated block (or named classes) of a model
  without editing it, with full recomputation or the selective policy (`policy.py`).
- `recompute_on_unpack()`: the `"selective_unpack"` policy as a context around a forward
  (`unpack_recompute.py`): no checkpoint region; cheap ops' saved outputs remade when backward unpacks them.
- `SavedActivationProbe`: the peak bytes of activations held for backward; `RecomputeProbe`: which ops
  recomputes run again, and their CPU time — to measure all of this.
See docs/activation_checkpointing.md.
"""
from .apply import checkpoint_blocks, repeated_blocks
from .checkpoint import checkpoint, non_reentrant_checkpoint
from .policy import all_matmuls_context, save_expensive_but_widening, save_expensive_ops, selective_context
from .probe import SavedActivationProbe
from .recompute_probe import RecomputeProbe
from .unpack_recompute import recompute_on_unpack
from .rng import RNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from .settings import configure, is_configured, profile_summary, reset, unconfigure

__all__ = ["RNGStatesTracker", "RecomputeProbe", "SavedActivationProbe", "all_matmuls_context", "checkpoint",
           "checkpoint_blocks", "configure", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "non_reentrant_checkpoint", "profile_summary", "recompute_on_unpack", "repeated_blocks", "reset",
           "save_expensive_but_widening", "save_expensive_ops", "selective_context", "unconfigure"]
