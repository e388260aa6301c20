"""Block-sparse attention in plain torch: forward and backward on any device, no Triton.

[Note: the computation] The layout's non-zero blocks are listed once, as (head, query block, key
block) triples, and the query-block rows are grouped by how many key blocks they attend to. A group
of R rows with c key blocks each is one call of torch's scaled-dot-product attention: the R query
tiles (R, block, dim) against their c gathered key and value tiles side by side (R, c·block, dim),
so each row's softmax runs over all of its keys in one fused kernel (no score tiles kept for
backward: the kernel keeps its log-sum-exp) and no row's output needs summing across calls. Time
and memory grow with the number of non-zero blocks, never with seq². The group outputs are put back
in row order with one gather. Masks (key padding, a (seq, seq) mask, relative-position scores) are
additive and cut to the same (R, block, c·block) shape from their tiles. A query row with nothing to
attend to (every key masked, or no block in its row) gives zeros, not NaNs. bf16 inputs: bf16 matmuls
inside the kernel, accumulated in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowGroup:
    """Query-block rows that attend to the same number of key blocks."""

    rows: torch.Tensor  # (R,) head * blocks + query block
    cols: torch.Tensor  # (R, c) head * blocks + key block, per row
    key_blocks: torch.Tensor  # (R, c) key block alone
    tiles: torch.Tensor  # (R, c) positions in the list of non-zero blocks (for per-tile masks)


@dataclass(frozen=True)
class BlockIndex:
    """The non-zero blocks of a `(heads, blocks, blocks)` layout, as flat indices and row groups."""

    heads: int
    blocks: int
    block: int
    rows: torch.Tensor  # (nnz,) head * blocks + query block
    cols: torch.Tensor  # (nnz,) head * blocks + key block
    key_blocks: torch.Tensor  # (nnz,) key block alone
    groups: tuple  # RowGroup per distinct count of key blocks
    order: torch.Tensor  # (heads * blocks,) where each row's output sits in the groups' outputs, then a zero tile

    @classmethod
    def of(cls, layout: torch.Tensor, block: int, device) -> "BlockIndex":
        heads, blocks, _ = layout.shape
        h, i, j = layout.nonzero(as_tuple=True)  # row-major: the tiles of a row are consecutive
        rows, cols = h * blocks + i, h * blocks + j
        counts = layout.reshape(heads * blocks, blocks).sum(-1)
        starts = torch.cumsum(counts, 0) - counts
        groups, placed = [], []
        for c in sorted(set(counts.tolist()) - {0}):
            members = (counts == c).nonzero(as_tuple=True)[0]
            tiles = starts[members, None] + torch.arange(c)
            groups.append(RowGroup(members.to(device), cols[tiles].to(device), j[tiles].to(device), tiles.to(device)))
            placed.append(members)
        order = torch.full((heads * blocks,), int(counts.gt(0).sum()), dtype=torch.long)  # empty rows: the zero tile
        if placed:
            members = torch.cat(placed)
            order[members] = torch.arange(members.numel())
        return cls(heads, blocks, block, rows.to(device), cols.to(device), j.to(device), tuple(groups),
                   order.to(device))


def _group_mask(group: RowGroup, index: BlockIndex, key_mask, tile_masks, dtype):
    """The additive mask of one group, (batch or 1, R, block, c·block), or None without masks."""
    r, c = group.cols.shape
    blk = index.block
    mask = None
    for tiles in tile_masks:  # (nnz, blk, blk) → (R, c, blk, blk) → (R, blk, c·blk)
        part = tiles.index_select(0, group.tiles.reshape(-1)).view(r, c, blk, blk).transpose(1, 2)
        part = part.reshape(1, r, blk, c * blk).to(dtype)
        mask = part if mask is None else mask + part
    if key_mask is not None:
        b = key_mask.shape[0]
        keys = key_mask.reshape(b, index.blocks, blk).index_select(1, group.key_blocks.reshape(-1))
        keys = keys.reshape(b, r, 1, c * blk).to(dtype)
        mask = keys if mask is None else mask + keys
    return mask


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
    tiles = [t.reshape(b, h * index.blocks, blk, d) for t in (q, k, v)]
    outs = []
    for group in index.groups:
        r, c = group.cols.shape
        qg = tiles[0].index_select(1, group.rows)
        kg, vg = (t.index_select(1, group.cols.reshape(-1)).view(b, r, c * blk, d) for t in tiles[1:])
        mask = _group_mask(group, index, key_mask, tile_masks, q.dtype)
        alive = None
        if mask is not None:
            alive = (mask > float("-inf")).any(-1, keepdim=True)  # a row with a key to attend to
            mask = mask.masked_fill(~alive, 0.0)  # a finite row for the kernel; its output is zeroed below
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        outs.append(out if alive is None else out.masked_fill(~alive, 0.0))
    outs.append(q.new_zeros((b, 1, blk, d)))  # the output of rows without blocks
    return torch.cat(outs, 1).index_select(1, index.order).reshape(b, h, s, d)
