"""DeepSpeed's block-sparsity patterns: same class names, arguments, defaults, validation errors and
`make_layout(seq_len)` layouts — a `(num_heads, blocks, blocks)` int64 tensor, 1 where a block of
queries attends to a block of keys.

[Note: random blocks] Variable and BigBird draw their random blocks with Python's `random.sample`, row
after row, as DeepSpeed does (so a seeded `random` gives DeepSpeed's layout). Ranks seeded differently
would draw different layouts, so when torch.distributed is initialised the layout is broadcast from
rank 0 (every rank must call `make_layout`, as every rank builds the attention layer).
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in _DIRECTIONS:
        raise NotImplementedError('only "uni/bi-directional" attentions are supported for now!')


def _check_horizontal(attention: str, horizontal: bool) -> None:
    if horizontal and attention != "bidirectional":
        raise ValueError('only "bi-directional" attentions can support horizontal global attention!')


def _check_global_ranges(starts, ends) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"Global block start indices length, {len(starts)}, must be same as global block end "
                         f"indices length, {len(ends)}!")
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"Global block start index, {start}, must be smaller than global block end index, {end}!")


def _at_most_blocks(what: str, count: int, num_blocks: int) -> None:
    if num_blocks < count:
        raise ValueError(f"Number of {what}, {count}, must be smaller than overall number of blocks in a row, "
                         f"{num_blocks}!")


def _window(layout_h: torch.Tensor, start: int, end: int, causal: bool) -> None:
    """Blocks [start, end) attend to each other (to earlier ones only, when causal)."""
    size = end - start
    square = torch.ones(size, size, dtype=layout_h.dtype)
    layout_h[start:end, start:end] |= torch.tril(square) if causal else square


def _sliding(layout_h: torch.Tensor, width: int, causal_end: bool = False) -> None:
    n = layout_h.shape[0]
    rows = torch.arange(n).unsqueeze(1)
    cols = torch.arange(n).unsqueeze(0)
    half = width // 2
    near = (cols >= rows - half) & ((cols <= rows) if causal_end else (cols <= rows + half))
    layout_h |= near.to(layout_h.dtype)


def _random_blocks(layout_h: torch.Tensor, count: int, causal: bool) -> None:
    """`count` random key blocks per row, drawn row after row with `random.sample` (module note);
    from the row's past only when causal (BigBird's unidirectional; Variable draws from all)."""
    n = layout_h.shape[0]
    _at_most_blocks("random blocks", count, n)
    for row in range(n):
        layout_h[row, random.sample(range(row + 1) if causal else range(n), count)] = 1


def _global_ranges(layout_h, starts, ends, rows: bool, causal_columns: bool) -> None:
    """Global blocks: every row attends to their columns (from their own row on when causal), and
    with `rows` they attend to every block."""
    n = layout_h.shape[0]
    for start, end in zip(starts, ends if ends is not None else [s + 1 for s in starts]):
        if start >= n:
            continue
        end = min(end, n)
        if rows:
            layout_h[start:end, :] = 1
        layout_h[start if causal_columns else 0:, start:end] = 1


class SparsityConfig:
    """What every pattern shares: heads, block size, and whether heads get layouts of their own."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        blocks = seq_len // self.block
        return torch.zeros((self.num_heads, blocks, blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_head_layout(h, layout)
        layout = self.check_and_propagate_first_head_layout(layout)
        if self.draws_random_blocks() and dist.is_available() and dist.is_initialized():
            # module note: every rank uses rank 0's random blocks (NCCL broadcasts device tensors only)
            # NCCL's device is the one the process bound (the engine's init_distributed sets it; ops/ imports
            # only torch, so it is read from torch, named here rather than left to .cuda()'s default)
            nccl = dist.get_backend() == "nccl"
            wire = layout.to(torch.device("cuda", torch.cuda.current_device())) if nccl else layout
            dist.broadcast(wire, src=0)
            layout = wire.cpu()
        return layout

    steps: tuple[str, ...] = ()  # the methods that set one head's layout, in DeepSpeed's order

    def set_head_layout(self, h, layout):
        for step in self.steps:
            getattr(self, step)(h, layout)

    def draws_random_blocks(self) -> bool:
        return getattr(self, "num_random_blocks", 0) > 0


class DenseSparsityConfig(SparsityConfig):
    """Every block: dense attention, for comparison."""

    steps = ("set_dense_layout",)

    def set_dense_layout(self, h, layout):
        layout[h] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformers' "fixed" pattern (arXiv 1904.10509), as DeepSpeed customised it: local
    windows of `num_local_blocks`, and the last `num_global_blocks` of each window (another slot per
    head with `num_different_global_patterns`) attended by all rows."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4, num_global_blocks=1,
                 attention="bidirectional", horizontal_global_attention=False, num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = num_local_blocks
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number "
                             f"of global blocks, {num_global_blocks}!")
        self.num_global_blocks = num_global_blocks
        _check_attention(attention)
        self.attention = attention
        _check_horizontal(attention, horizontal_global_attention)
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("Number of different layouts cannot be more than one when you have set a single layout "
                             "for all heads! Set different_layout_per_head to True.")
        slots = num_local_blocks // num_global_blocks
        if num_different_global_patterns > slots:
            raise ValueError(f"Number of layout versions (num_different_global_patterns), "
                             f"{num_different_global_patterns}, cannot be larger than number of local window blocks "
                             f"divided by number of global blocks, {num_local_blocks} / {num_global_blocks} = {slots}!")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        for start in range(0, n, self.num_local_blocks):
            _window(layout[h], start, min(start + self.num_local_blocks, n), self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h, layout):
        n, g = layout.shape[1], self.num_global_blocks
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * g
        full = n - n % self.num_local_blocks  # blocks in whole windows
        starts = list(range(offset, full, self.num_local_blocks))
        if full < n:  # a short last window: its global blocks, kept inside the sequence
            starts.append(min(full + offset, n - g))
        causal = self.attention != "bidirectional"
        _global_ranges(layout[h], starts, [s + g for s in starts], self.horizontal_global_attention, causal)
        return layout

    steps = ("set_local_layout", "set_global_layout")


class VariableSparsityConfig(SparsityConfig):
    """Fixed, generalised: random blocks per row, local windows of the sizes listed (the last size
    repeats), and global blocks at the indices (or index ranges) listed."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=0,
                 local_window_blocks=[4], global_block_indices=[0], global_block_end_indices=None,  # noqa: B006 - DeepSpeed's
                 attention="bidirectional", horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices
        _check_attention(attention)
        self.attention = attention
        _check_horizontal(attention, horizontal_global_attention)
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        _random_blocks(layout[h], self.num_random_blocks, causal=False)
        return layout

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        causal = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _window(layout[h], start, min(start + size, n), causal) if start < n else None
            start += size
        size = self.local_window_blocks[-1]
        for begin in range(start, n, size):
            _window(layout[h], begin, min(begin + size, n), causal)
        return layout

    def set_global_layout(self, h, layout):
        _global_ranges(layout[h], self.global_block_indices, self.global_block_end_indices,
                       self.horizontal_global_attention, self.attention != "bidirectional")
        return layout

    steps = ("set_random_layout", "set_local_layout", "set_global_layout")


class _SlidingWindow(SparsityConfig):
    """Patterns with a window of `num_sliding_window_blocks` centred on each block (to its end only
    when `causal_window`)."""

    causal_window = False

    def set_sliding_window_layout(self, h, layout):
        _at_most_blocks("sliding window blocks", self.num_sliding_window_blocks, layout.shape[1])
        _sliding(layout[h], self.num_sliding_window_blocks, causal_end=self.causal_window)
        return layout


class BigBirdSparsityConfig(_SlidingWindow):
    """BigBird (arXiv 2007.14062): random blocks, a sliding window, and the first blocks global."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=1,
                 num_sliding_window_blocks=3, num_global_blocks=1, attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        _check_attention(attention)
        self.attention = attention

    def set_random_layout(self, h, layout):
        _random_blocks(layout[h], self.num_random_blocks, causal=self.attention != "bidirectional")
        return layout

    def set_global_layout_itc(self, h, layout):
        _at_most_blocks("global blocks", self.num_global_blocks, layout.shape[1])
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout[:] = torch.tril(layout)  # DeepSpeed clears the future of every head here
        return layout

    steps = ("set_random_layout", "set_sliding_window_layout", "set_global_layout_itc")


class BSLongformerSparsityConfig(_SlidingWindow):
    """Block-sparse Longformer (arXiv 2004.05150): a sliding window and global blocks (rows and
    columns) at the indices or index ranges listed."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_sliding_window_blocks=3,
                 global_block_indices=[0], global_block_end_indices=None, attention="bidirectional"):  # noqa: B006
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.attention = attention
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices


    def set_global_layout(self, h, layout):
        _global_ranges(layout[h], self.global_block_indices, self.global_block_end_indices, True, False)
        if self.attention == "unidirectional":
            layout[:] = torch.tril(layout)
        return layout

    steps = ("set_sliding_window_layout", "set_global_layout")


class LocalSlidingWindowSparsityConfig(_SlidingWindow):
    """A sliding window only (to earlier blocks only when unidirectional, the default)."""

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention="unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention
        self.causal_window = attention != "bidirectional"

    steps = ("set_sliding_window_layout",)
