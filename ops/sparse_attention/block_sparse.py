"""Block-sparse attention in plain torch: forward and backward on any device, no Triton.

[Note: the computation] The layout's non-zero blocks are listed once, as (head, query block, key
block) triples. Each is one `block x block` tile of scores, computed by a batched matmul of the
gathered query and key blocks, so time and memory grow with the number of non-zero blocks, never with
seq². The softmax runs over each query row across its tiles: the row maximum (a constant for the
softmax, so it carries no gradient) and the row sum are reduced over the tiles of a row with
`scatter_reduce`/`index_add`, and the output is the tile probabilities times the value blocks, added
into the query blocks they belong to. Autograd differentiates all of it. Scores, maxima and sums are
fp32 whatever the input dtype (bf16 inputs: bf16 matmuls, an fp32 softmax). A query row with nothing
to attend to (every key masked) gives zeros, not NaNs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockIndex:
    """The non-zero blocks of a `(heads, blocks, blocks)` layout, as flat indices."""

    heads: int
    blocks: int
    block: int
    rows: torch.Tensor  # (nnz,) head * blocks + query block
    cols: torch.Tensor  # (nnz,) head * blocks + key block
    key_blocks: torch.Tensor  # (nnz,) key block alone

    @classmethod
    def of(cls, layout: torch.Tensor, block: int, device) -> "BlockIndex":
        heads, blocks, _ = layout.shape
        h, i, j = layout.nonzero(as_tuple=True)
        return cls(heads, blocks, block, (h * blocks + i).to(device), (h * blocks + j).to(device), j.to(device))


def _tiles(x: torch.Tensor, index: torch.Tensor, block: int) -> torch.Tensor:
    """(batch, heads, seq, dim) → the blocks listed by `index`: (batch, nnz, block, dim)."""
    b, h, s, d = x.shape
    return x.reshape(b, h * (s // block), block, d).index_select(1, index)


def _row_mask(mask: torch.Tensor, index: BlockIndex) -> torch.Tensor:
    """An additive (batch, seq) key mask → per tile (batch, nnz, 1, block)."""
    b = mask.shape[0]
    keys = mask.reshape(b, index.blocks, index.block).index_select(1, index.key_blocks)
    return keys.unsqueeze(2)


def square_tiles(mask: torch.Tensor, index: BlockIndex) -> torch.Tensor:
    """A (seq, seq) or (heads, seq, seq) mask → its tiles (nnz, block, block), read in place
    (never expanded over heads: that would be heads × seq²)."""
    blk, n = index.block, index.blocks
    query_blocks = index.rows % n
    if mask.dim() == 2:
        return mask.view(n, blk, n, blk)[query_blocks, :, index.key_blocks, :]
    return mask.view(index.heads, n, blk, n, blk)[index.rows // n, query_blocks, :, index.key_blocks, :]


def block_sparse_attention(q, k, v, index: BlockIndex, scale: float, key_mask=None, tile_masks=()):
    """softmax(q kᵀ · scale + masks) v over the blocks of `index`; q, k, v: (batch, heads, seq, dim).
    `key_mask`: additive (batch, seq); `tile_masks`: additive, per tile (nnz, block, block) — the
    `square_tiles` of a (seq, seq) mask, so that no seq² work is done here."""
    b, h, s, d = q.shape
    blk = index.block
    # the scale on q (seq x dim) instead of on the scores (nnz x block²)
    qt, kt, vt = _tiles(q * scale, index.rows, blk), _tiles(k, index.cols, blk), _tiles(v, index.cols, blk)
    scores = torch.matmul(qt, kt.transpose(-1, -2)).float()  # (b, nnz, blk, blk)
    if key_mask is not None:
        scores = scores + _row_mask(key_mask.float(), index)
    for mask in tile_masks:
        scores = scores + mask.float()
    rows = h * index.blocks
    with torch.no_grad():  # the row maximum only keeps exp() in range (module note)
        row_max = scores.new_full((b, rows, blk), float("-inf"))
        where = index.rows.view(1, -1, 1).expand(b, -1, blk)
        row_max = row_max.scatter_reduce(1, where, scores.amax(-1), "amax")
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max.index_select(1, index.rows).unsqueeze(-1))
    row_sum = scores.new_zeros((b, rows, blk)).index_add(1, index.rows, weights.sum(-1))
    row_sum = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    # normalise after the sum over a row's tiles: a (rows, block, dim) division instead of one per tile,
    # and the unnormalised weights are what exp() saves for backward anyway
    out = q.new_zeros((b, rows, blk, d), dtype=torch.float32).index_add(1, index.rows,
                                                                      torch.matmul(weights.to(v.dtype), vt).float())
    return (out / row_sum.unsqueeze(-1)).to(q.dtype).reshape(b, h, s, d)
