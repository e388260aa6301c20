"""Partition layout shared by ZeRO stages 1-3 (DESIGN.md decision 2).

[Note: chunks] Every trainable parameter is split along dim 0 into `world` chunks with torch.chunk
semantics: `c = ceil(rows / world)` rows per chunk, the last ones shorter or empty (a 1-element
parameter on 4 ranks is 1, 0, 0, 0 rows). Rank r owns chunk r. For the collectives every chunk is
padded to `c * row_numel` elements, so all ranks contribute and receive equal sizes.
[Note: flat partition] A rank keeps its padded chunks back to back in one fp32 flat buffer per
(param group, model dtype): the master weights, their gradients and therefore the optimizer state
(one torch Parameter per flat), so a fused optimizer steps a few large tensors. `Fragment` maps a
parameter to its slot. Padding slots hold zero weights and zero gradients: Adam/AdamW/Adagrad/SGD
keep them at zero and they add nothing to norms.
[Note: rank-major] A collective over a run of parameters exchanges a buffer laid out
[rank 0: p1 chunk 0 | p2 chunk 0 | ...][rank 1: p1 chunk 1 | ...]; `RankMajorLayout` packs full
tensors into it and unpacks it back. Segment r of a run is exactly the run's slots in rank r's flat
partition, so an all-gather sends a slice of the flat buffer without a copy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from offload.huge_pages import flat_zeros

from .partition_store import HostPartitionStore


@dataclass(frozen=True)
class ChunkSpec:
    rows: int
    row_numel: int
    chunk_rows: int  # rows per chunk, ceil(rows / world)

    @classmethod
    def of(cls, param: torch.Tensor, world: int) -> "ChunkSpec":
        rows = param.shape[0] if param.dim() > 0 else 1
        row_numel = param.numel() // rows if rows else 0
        return cls(rows, row_numel, -(-rows // world))

    @property
    def padded(self) -> int:
        return self.chunk_rows * self.row_numel

    def row_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.chunk_rows, self.rows)
        return start, min(start + self.chunk_rows, self.rows)

    def numel_of(self, rank: int) -> int:
        start, stop = self.row_range(rank)
        return (stop - start) * self.row_numel


@dataclass(frozen=True)
class Fragment:
    """This rank's piece of one parameter: `numel` real elements at `offset` of flat `key`, padded to
    `padded`; `shape` is the chunk's shape (dim 0 may be 0)."""

    key: tuple[int, torch.dtype]
    offset: int
    numel: int
    padded: int
    shape: tuple[int, ...]
    spec: ChunkSpec


class RankMajorLayout:
    """A run of parameters exchanged in one collective (see the module note)."""

    def __init__(self, params: list[torch.Tensor], specs: list[ChunkSpec], world: int):
        self.params, self.specs, self.world = list(params), list(specs), world
        self.offsets, seg = [], 0
        for s in self.specs:
            self.offsets.append(seg)
            seg += s.padded
        self.segment = seg

    @property
    def numel(self) -> int:
        return self.world * self.segment

    def _slots(self, i: int, buffer: torch.Tensor):
        s, off = self.specs[i], self.offsets[i]
        full = s.rows // s.chunk_rows if s.chunk_rows else 0  # chunks with all c rows
        rest = (s.rows - full * s.chunk_rows) * s.row_numel  # elements of the short chunk
        return buffer.view(self.world, self.segment)[:, off:off + s.padded], full, rest

    def pack_one(self, i: int, tensor: torch.Tensor, buffer: torch.Tensor, zero_padding: bool = True,
                 accumulate: bool = False) -> None:
        """Scatter parameter i's full `tensor` into its slots of `buffer` (casting as needed); with
        `accumulate`, add it to what is packed there already."""
        slots, full, rest = self._slots(i, buffer)
        flat = tensor.reshape(-1)
        cr = slots.shape[1]
        if full:
            dst, src = slots[:full], flat[:full * cr].view(full, cr)
            dst.add_(src) if accumulate else dst.copy_(src)
        if rest:
            dst, src = slots[full, :rest], flat[full * cr:]
            dst.add_(src) if accumulate else dst.copy_(src)
        if zero_padding and not accumulate:
            if rest:
                slots[full, rest:].zero_()
            slots[full + (1 if rest else 0):].zero_()

    def zero_one(self, i: int, buffer: torch.Tensor) -> None:
        """Zero parameter i's slots of `buffer` (a parameter that got no gradient contributes zeros)."""
        self._slots(i, buffer)[0].zero_()

    @torch.no_grad()
    def unpack(self, buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Gather every parameter's chunks from `buffer` back into the full `targets`."""
        for i, target in enumerate(targets):
            if target.is_contiguous():
                self._unpack_one(i, buffer, target)
            else:  # other strides (transposed, channels_last): chunks are in index order, so stage it
                staged = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                self._unpack_one(i, buffer, staged)
                target.copy_(staged)

    def _unpack_one(self, i: int, buffer: torch.Tensor, target: torch.Tensor) -> None:
        slots, full, rest = self._slots(i, buffer)
        flat = target.view(-1)
        cr = slots.shape[1]
        if full:
            flat[:full * cr].view(full, cr).copy_(slots[:full])
        if rest:
            flat[full * cr:].copy_(slots[full, :rest])

    def segment_slots(self, segment: torch.Tensor) -> list[torch.Tensor]:
        """Views of one rank's segment, one padded slot per parameter."""
        return [segment[off:off + s.padded] for off, s in zip(self.offsets, self.specs)]


def land_slots(targets, slots: list[torch.Tensor], accumulate: bool) -> None:
    """A reduced segment's slots into a bucket's partition-gradient targets: tensors (copied or added),
    or the gradient swap file's (`grad_swap.SwappedTargets`)."""
    if hasattr(targets, "land"):
        targets.land(slots, accumulate)
    elif accumulate:
        torch._foreach_add_(targets, slots)
    else:
        torch._foreach_copy_(targets, slots)


def split_runs(items: list, sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index runs whose sizes sum to at most `limit` (a single larger item is its own run)."""
    runs, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        runs.append(current)
    return runs


class PartitionedParams:
    """fp32 master partitions of an optimizer's trainable parameters on this rank, and the optimizer
    rewired to step them (one flat Parameter per param group and model dtype)."""

    grads_swapped = False  # NVMe optimizer: the gradient partition is in swap files (grad_swap.py)

    def __init__(self, optimizer: torch.optim.Optimizer, world: int, rank: int, tier=None,
                 grads_swapped: bool | None = None):
        self.tier = tier  # where the flats live (tier.py); None: on the parameters' device
        if grads_swapped is not None:  # (Stage3Partition sets it itself before this runs)
            self.grads_swapped = grads_swapped
        if optimizer.state:
            raise ValueError("the optimizer already has state; ZeRO stages 1-3 need a fresh optimizer "
                             "(its state is built over this rank's partition of the fp32 master weights)")
        self.world, self.rank = world, rank
        self.fragments: dict[torch.nn.Parameter, Fragment] = {}
        self.members: dict[tuple, list[torch.nn.Parameter]] = {}
        self.flat: dict[tuple, torch.nn.Parameter] = {}
        self.flat_grad: dict[tuple, torch.Tensor] = {}
        self.store = HostPartitionStore(self)  # every reader of `flat` goes through it (partition_store.py)
        for gi, group in enumerate(optimizer.param_groups):
            keys = []
            for p in group["params"]:
                if p.requires_grad:
                    key = (gi, p.dtype)
                    if key not in self.members:
                        self.members[key] = []
                        keys.append(key)
                    self.members[key].append(p)
            for key in keys:
                self._build_flat(key)
            group["params"] = [self.flat[k] for k in keys]

    def _build_flat(self, key) -> None:
        offset = 0
        for p in self.members[key]:
            spec = ChunkSpec.of(p, self.world)
            start, stop = spec.row_range(self.rank)
            shape = (stop - start,) + tuple(p.shape[1:]) if p.dim() > 0 else (stop - start,)
            self.fragments[p] = Fragment(key, offset, spec.numel_of(self.rank), spec.padded, shape, spec)
            offset += spec.padded
        flat = flat_zeros(offset, torch.float32, self.members[key][0].device)  # huge pages on a host
        with torch.no_grad():
            for p in self.members[key]:
                frag = self.fragments[p]
                start = frag.spec.row_range(self.rank)[0] * frag.spec.row_numel
                flat[frag.offset:frag.offset + frag.numel].copy_(p.detach().reshape(-1)[start:start + frag.numel])
        self._set_flat(key, flat)

    def _set_flat(self, key, flat: torch.Tensor) -> None:
        """Make `flat` key's master partition, on its tier, with a zero gradient beside it."""
        if self.tier is not None:
            flat = self.tier.place(flat)
        self.flat[key] = torch.nn.Parameter(flat)
        if self.grads_swapped:  # shapes only: the values are in swap files (grad_swap.py's note)
            self.flat_grad[key] = torch.empty(flat.shape, dtype=flat.dtype, device="meta")
            return
        self.flat_grad[key] = flat_zeros(flat.numel(), flat.dtype, flat.device, pin_memory=flat.is_pinned())
        self.flat[key].grad = self.flat_grad[key]

    def params(self) -> list[torch.nn.Parameter]:
        return [p for members in self.members.values() for p in members]

    def slot(self, param: torch.nn.Parameter, flat: dict) -> torch.Tensor:
        """`param`'s padded slot in one of the per-key flat dicts (`flat`, `flat_grad`)."""
        frag = self.fragments[param]
        return flat[frag.key].detach()[frag.offset:frag.offset + frag.padded]

    def gather_runs(self, bucket_numel: int) -> list[tuple[tuple, int, int, RankMajorLayout]]:
        """All-gather buckets: (key, start, stop, layout) over contiguous slot runs of each flat."""
        runs = []
        for key, members in self.members.items():
            specs = [self.fragments[p].spec for p in members]
            for run in split_runs(members, [self.world * s.padded for s in specs], bucket_numel):
                layout = RankMajorLayout([members[i] for i in run], [specs[i] for i in run], self.world)
                start = self.fragments[members[run[0]]].offset
                runs.append((key, start, start + layout.segment, layout))
        return runs

    def num_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for master weights and their gradients (padding included)."""
        n = sum(f.numel() * f.element_size() for f in self.flat.values())
        grads = [g for g in self.flat_grad.values() if not g.is_meta]  # swapped: no host bytes
        return {"master": n, "master_grad": sum(g.numel() * g.element_size() for g in grads)}


# [Note: reductions in flight] A gradient bucket's hook waits for the oldest reduction once more than
# REDUCE_DEPTH are in flight, and that wait stalls backward. Measured on the 25M GPT, ZeRO-1, 2 ranks,
# 5e6-element buckets: time spent in the hooks per step 150 ms with 2 in flight, 40 ms with 4, 40-50 ms
# with 8; the send buffers held stay bounded by 4 buckets.
REDUCE_DEPTH = 4


class InFlight:
    """Bounded queue of started collectives: at most `depth` outstanding, finished oldest first, so the
    temporary buffers they hold stay bounded."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self.queue: deque = deque()

    def push(self, work, finish) -> None:
        self.queue.append((work, finish))
        while len(self.queue) > self.depth:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, finish = self.queue.popleft()
        if work is not None:
            work.wait()
        finish()

    def drain(self) -> None:
        while self.queue:
            self._finish_oldest()
