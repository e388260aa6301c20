"""Tensor parallelism (Megatron-LM's, arXiv:1909.08053): matrices split across the ranks of the
topology's model group.

- `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` (layers.py) and
  `vocab_parallel_cross_entropy` (cross_entropy.py), which never gathers the vocabulary;
- `ParallelSelfAttention` (heads split across ranks), `ParallelMLP` (attention.py);
- `KeyValueHeadLinear`: k/v projections with fewer key/value heads than ranks (kv_heads.py, AutoTP's);
- the region collectives, one autograd function each (mappings.py);
- `tensor_parallel_grad_norm` and the share a whole-model norm adds up (grads.py);
- dropout streams: `engine.checkpointing.get_cuda_rng_tracker` / `model_parallel_cuda_manual_seed`
  (one tracker, shared with activation checkpointing), and the per-rank regions between a column- and
  a row-parallel layer that AutoTP and `initialize` mark (dropout_region.py).
Every layer takes `group=` (a ProcessGroup or Communicator); by default the topology's model group.
See README.md, "Tensor parallelism".
"""
from .attention import ParallelMLP, ParallelSelfAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .grads import tensor_parallel_grad_norm, tensor_parallel_grad_norm_squared
from .group import ModelParallelUnit, tensor_parallel_comm
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, is_partitioned
from .mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, scatter_to_tensor_parallel_region)

__all__ = ["ColumnParallelLinear", "ModelParallelUnit", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
           "VocabParallelEmbedding", "copy_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "is_partitioned", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
           "tensor_parallel_comm", "tensor_parallel_grad_norm", "tensor_parallel_grad_norm_squared",
           "vocab_parallel_cross_entropy"]
