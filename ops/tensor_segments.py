"""Per-tensor reductions over flat buffers that hold pieces of many tensors (ZeRO's partitions).

A `FlatRuns` lists one flat buffer's fragments as runs (offset, length, tensor index; the index is
global, shared by all ranks). A per-tensor rule (LAMB's trust ratio) adds each fragment's Σx² into one
vector of per-tensor partial sums, the partial sums of every flat of every rank are summed in one
reduction, and each fragment is then scaled by its own tensor's value: the rule sees exactly the
norms of the whole tensors.

[Note: rows] A flat is read in windows [s, e) whose start is a multiple of ROW (ops/lamb.py's blocks,
the NVMe tier's sub-groups). Each ROW-element row, counted from the flat's start, that lies inside one
fragment is summed by one vectorised reduction (`view(rows, ROW).sum(1)`, whose result for a row does
not depend on how many rows the view has); the elements of rows that a fragment boundary cuts, and of
the flat's last partial row, are added one by one. Within a window every fragment's addends go in flat
order (its elements before its first whole row, its rows, its elements after its last whole row), and
`index_add_` on the host adds its source in order. So a tensor's partial sum receives the same addends
in the same order however the flat is cut into windows, and the in-memory step and the NVMe step,
which cut it differently, get the same bits. Scaling needs no per-element index either: one value per
row, and a gather only for the cut rows' elements.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable

import torch

ROW = 64  # elements per row: nvme_tier.LANES and ops.lamb.BLOCK are multiples of it


@dataclass(frozen=True)
class WindowPlan:
    """Which tensor each element of one window [s, e) of a flat belongs to, by rows (module note)."""

    rows: int  # whole rows in the window
    row_ids: torch.Tensor  # int64 (rows,): a row's tensor; a cut row's first element's (its sum is dropped)
    cut_rows: torch.Tensor  # int64: rows cut by a fragment boundary
    head: tuple[torch.Tensor, torch.Tensor]  # (positions, tensor ids) added before the rows
    tail: tuple[torch.Tensor, torch.Tensor]  # (positions, tensor ids) added after the rows
    loose: tuple[torch.Tensor, torch.Tensor]  # head and tail together (scaling has no order)
    counts: tuple[int, int, int]  # cut rows, head and tail elements (host ints: empty steps skipped)

    def add_squares(self, partial: torch.Tensor, values: torch.Tensor) -> None:
        """partial[i] += Σ values² over the window's elements of tensor i, in the module note's order."""
        sq = values.detach().float().square()
        row_sums = sq[:self.rows * ROW].view(self.rows, ROW).sum(1)
        cut, head, tail = self.counts
        if cut:
            row_sums.index_fill_(0, self.cut_rows, 0.0)  # their elements go one by one (x + 0.0 is x)
        if head:
            partial.index_add_(0, self.head[1].to(partial.device), sq[self.head[0]].to(partial.device))
        partial.index_add_(0, self.row_ids.to(partial.device), row_sums.to(partial.device))
        if tail:
            partial.index_add_(0, self.tail[1].to(partial.device), sq[self.tail[0]].to(partial.device))

    def scale(self, values: torch.Tensor, per_tensor: torch.Tensor) -> torch.Tensor:
        """values[j] *= per_tensor[tensor of element j], in place; returns `values`."""
        per_tensor = per_tensor.to(values.device)
        pos, ids = self.loose
        cut = values[pos] * per_tensor[ids] if pos.numel() else None
        values[:self.rows * ROW].view(self.rows, ROW).mul_(per_tensor[self.row_ids].unsqueeze(1))
        if cut is not None:
            values[pos] = cut
        return values


class FlatRuns:
    """One flat's fragments as sorted runs; `plan(s, e)` says which tensor each element of a window is."""

    def __init__(self, runs: list[tuple[int, int, int]], device: torch.device, cache: bool = False):
        """`runs`: (offset, length, tensor index) covering the flat. `cache`: keep each window's plan (an
        in-memory flat steps the same windows every step; the NVMe step builds its sub-groups' on demand,
        holding nothing partition-sized)."""
        self.runs = sorted(runs)
        self.starts = [r[0] for r in self.runs]
        self.device, self._plans = device, {} if cache else None

    def plan(self, s: int, e: int) -> WindowPlan:
        if self._plans is not None and (s, e) in self._plans:
            return self._plans[(s, e)]
        plan = self._build(s, e)
        if self._plans is not None:
            self._plans[(s, e)] = plan
        return plan

    def _build(self, s: int, e: int) -> WindowPlan:
        assert s % ROW == 0, f"a window starts at a multiple of {ROW} (module note), not {s}"
        rows = (e - s) // ROW
        row_ids = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        head, tail = [], []
        for offset, length, index in self.runs[max(0, bisect_right(self.starts, s) - 1):]:
            if offset >= e:
                break
            a, b = max(offset, s) - s, min(offset + length, e) - s
            if a >= b:
                continue
            first, last = -(-a // ROW) * ROW, min(b // ROW, rows) * ROW  # its whole rows: [first, last)
            if first >= last:
                head.append((a, b, index))
                continue
            row_ids[first // ROW:last // ROW] = index
            if a < first:
                head.append((a, first, index))
            if last < b:
                tail.append((last, b, index))
        cut = row_ids < 0
        cut_rows = cut.nonzero().view(-1)
        row_ids[cut] = 0
        head_at, tail_at = self._positions(head), self._positions(tail)
        loose = (torch.cat([head_at[0], tail_at[0]]), torch.cat([head_at[1], tail_at[1]]))
        counts = (cut_rows.numel(), head_at[0].numel(), tail_at[0].numel())
        return WindowPlan(rows, row_ids, cut_rows, head_at, tail_at, loose, counts)

    def _positions(self, pieces: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pos = [torch.arange(a, b, dtype=torch.int64, device=self.device) for a, b, _ in pieces]
        ids = [torch.full((b - a,), i, dtype=torch.int64, device=self.device) for a, b, i in pieces]
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return (torch.cat(pos) if pos else empty), (torch.cat(ids) if ids else empty)


@dataclass
class SegmentedReduction:
    """Where a per-tensor optimizer finds its flats' runs and the one cross-rank sum it may call."""

    segments: dict  # flat tensor -> FlatRuns
    count: int  # tensors in the whole (global) index space
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]  # sums a vector over ranks, returns the result
