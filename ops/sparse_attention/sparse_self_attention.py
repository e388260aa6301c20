"""`SparseSelfAttention`: DeepSpeed's layer (same constructor and forward), computed by
`block_sparse.block_sparse_attention` instead of Triton kernels."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .block_sparse import BlockIndex, block_sparse_attention, square_tiles
from .sparsity_config import SparsityConfig

_MODES = ("add", "mul")


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """'add' masks are added to the scores as they are; 'mul' masks keep where non-zero (DeepSpeed):
    a boolean keep-mask (what the attention kernel takes without conversion when it is the only one)."""
    if mode == "add":
        return mask
    return mask != 0


class SparseSelfAttention(nn.Module):
    """Block-sparse scaled dot-product attention over `sparsity_config`'s layout.

    forward(query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
    query/key/value (batch, heads, seq, head_dim), seq a multiple of the block and at most
    `max_seq_length`; `rpe` relative-position scores (seq, seq) or (heads, seq, seq), added;
    `key_padding_mask` (batch, seq) and `attn_mask` (seq, seq), added or multiplied as their modes say.
    """

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        if sparsity_config is None:
            from .sparsity_config import FixedSparsityConfig
            sparsity_config = FixedSparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MODES:
                raise NotImplementedError(f"{name}: {mode!r} is not one of {_MODES}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length), persistent=False)
        self._indices: dict = {}

    def keep_heads(self, start: int, stop: int) -> None:
        """Attend with heads [start, stop) of the layout only (a tensor-parallel rank's heads, which
        AutoTP gives it). The sparsity config is copied first: several layers may share one."""
        config = copy.copy(self.sparsity_config)
        config.num_heads = stop - start
        self.sparsity_config = config
        self.master_layout = self.master_layout[start:stop].clone()
        self._indices = {}

    def get_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len % self.sparsity_config.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size "
                             f"{self.sparsity_config.block}!")
        if seq_len > self.max_seq_length:
            raise ValueError(f"sequence length {seq_len} is longer than max_seq_length {self.max_seq_length}; "
                             "build SparseSelfAttention with a larger max_seq_length")
        blocks = seq_len // self.sparsity_config.block
        return self.master_layout[..., :blocks, :blocks]

    def _index(self, seq_len: int, device) -> BlockIndex:
        key = (seq_len, str(device))
        if key not in self._indices:
            self._indices[key] = BlockIndex.of(self.get_layout(seq_len).cpu(), self.sparsity_config.block, device)
        return self._indices[key]

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"SparseSelfAttention: query dtype {query.dtype} is not float32, bfloat16 or float16")
        if not (query.shape == key.shape == value.shape):
            raise NotImplementedError("SparseSelfAttention: query, key and value must have one shape "
                                      f"(batch, heads, seq, head_dim); got {query.shape}, {key.shape}, {value.shape}")
        seq_len, heads = query.shape[2], query.shape[1]
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"SparseSelfAttention: the input has {heads} heads, the sparsity config "
                             f"{self.sparsity_config.num_heads}")
        index = self._index(seq_len, query.device)
        key_mask = None if key_padding_mask is None else _additive(key_padding_mask, self.key_padding_mask_mode)
        # tiles first, then the mode's conversion: work on the non-zero blocks only, never on seq²
        tiles = [] if rpe is None else [square_tiles(rpe, index)]
        if attn_mask is not None:
            tiles.append(square_tiles(attn_mask, index).map(lambda t: _additive(t, self.attn_mask_mode)))
        scale = float(query.shape[-1]) ** -0.5
        return block_sparse_attention(query, key, value, index, scale, key_mask, tiles)
