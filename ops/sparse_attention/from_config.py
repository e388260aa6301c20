"""The `sparse_attention` config section as a sparsity pattern (DeepSpeed's engine parses the section
and leaves it to user code; here `sparsity_config_from` is that user code, and the GPT example
calls it)."""
from __future__ import annotations

from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)


def sparsity_config_from(sparse_attention, num_heads: int) -> SparsityConfig:
    """`sparse_attention`: a `schemas.features.SparseAttentionConfig`; each mode takes the keys DeepSpeed's takes."""
    common = dict(num_heads=num_heads, block=sparse_attention.block, different_layout_per_head=sparse_attention.different_layout_per_head)
    mode = sparse_attention.mode
    if mode == "dense":
        return DenseSparsityConfig(**common)
    if mode == "fixed":
        return FixedSparsityConfig(**common, num_local_blocks=sparse_attention.num_local_blocks,
                                   num_global_blocks=sparse_attention.num_global_blocks, attention=sparse_attention.attention,
                                   horizontal_global_attention=sparse_attention.horizontal_global_attention,
                                   num_different_global_patterns=sparse_attention.num_different_global_patterns)
    if mode == "variable":
        return VariableSparsityConfig(**common, num_random_blocks=sparse_attention.num_random_blocks,
                                      local_window_blocks=sparse_attention.local_window_blocks,
                                      global_block_indices=sparse_attention.global_block_indices,
                                      global_block_end_indices=sparse_attention.global_block_end_indices,
                                      attention=sparse_attention.attention,
                                      horizontal_global_attention=sparse_attention.horizontal_global_attention)
    if mode == "bigbird":
        return BigBirdSparsityConfig(**common, num_random_blocks=sparse_attention.num_random_blocks,
                                     num_sliding_window_blocks=sparse_attention.num_sliding_window_blocks,
                                     num_global_blocks=sparse_attention.num_global_blocks, attention=sparse_attention.attention)
    return BSLongformerSparsityConfig(**common, num_sliding_window_blocks=sparse_attention.num_sliding_window_blocks,
                                      global_block_indices=sparse_attention.global_block_indices,
                                      global_block_end_indices=sparse_attention.global_block_end_indices,
                                      attention=sparse_attention.attention)
