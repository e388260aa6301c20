"""Block-sparse attention (DeepSpeed's `deepspeed.ops.sparse_attention`), in plain torch: forward and
backward on CPU and CUDA, fp32/bf16, no Triton (DeepSpeed's needs Triton 1.0 and torch < 2).

- Sparsity patterns: `DenseSparsityConfig`, `FixedSparsityConfig`, `VariableSparsityConfig`,
  `BigBirdSparsityConfig`, `BSLongformerSparsityConfig`, `LocalSlidingWindowSparsityConfig`;
  `make_layout(seq_len)` gives DeepSpeed's `(heads, blocks, blocks)` layouts.
- `SparseSelfAttention(sparsity_config, key_padding_mask_mode, attn_mask_mode, max_seq_length)`.
- `SparseAttentionUtils`: pad to the block size, unpad, extend position embeddings.
- `sparsity_config_from(section, num_heads)`: the config's `sparse_attention` section as a pattern.
- `reference.masked_dense_attention`: the fp64 dense oracle the tests and the GPU script compare with.
"""
from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from .from_config import sparsity_config_from
from .utils import SparseAttentionUtils

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention", "SparsityConfig",
           "VariableSparsityConfig", "sparsity_config_from"]
