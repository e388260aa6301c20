"""The oracle for `SparseSelfAttention`: dense attention over the layout expanded to tokens, in fp64,
written without any of `block_sparse`'s tiling (tests/test_sparse_attention.py and the GPU script's
checks, benchmarks/gpu/long_sequence_checks.py, compare against it)."""
from __future__ import annotations

import torch


def masked_dense_attention(q, k, v, layout, block: int, key_add=None, square_add=()) -> torch.Tensor:
    """softmax(q kᵀ / √dim + masks) v in fp64 on q's device, over the keys `layout` (heads, blocks,
    blocks) allows; `key_add` an additive (batch, seq) mask, `square_add` additive (seq, seq) or
    (heads, seq, seq) masks. A query row with nothing to attend to gives zeros and passes no gradient
    (the contract of `block_sparse`): its softmax runs over zeros and is then dropped, since a softmax
    over -inf alone is NaN, and NaN times a zero gradient is still NaN in backward."""
    q, k, v = q.double(), k.double(), v.double()
    tile = torch.ones(block, block, dtype=torch.float64, device=q.device)
    allowed = torch.kron(layout.to(device=q.device, dtype=torch.float64), tile).bool()
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    for m in square_add:
        scores = scores + m.double()
    if key_add is not None:
        scores = scores + key_add.double()[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0) @ v
