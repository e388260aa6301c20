"""`partition_activations`: a checkpoint's inputs kept as this rank's 1/tp slice, made whole again by
an all-gather over the tensor-parallel group when the recompute needs them.

[Note: replicated activations] Tensor-parallel ranks hold the same activations between their
partitioned layers (that is what makes the slicing lossless), run the same checkpoints in the same
order, and get the same gradients for them. Both checkpoints rely on it:
- reentrant (`Partition`, a saved-tensor pack result): the slice is what autograd saves; backward
  unpacks it and all-gathers, every rank in the same order.
- non-reentrant (`Scatter`/`Gather`, autograd functions around the region): torch's non-reentrant
  checkpoint holds the region's inputs itself, so the region is given the slice (`Scatter`) and
  makes it whole inside (`Gather`, again in the recompute). Backward of `Gather` keeps this rank's
  piece of the (replicated) whole gradient, and backward of `Scatter` all-gathers the pieces into
  the whole gradient of the input: the gradient is unchanged, bit for bit.
With `contiguous_memory_optimization` the slices are copied into slots of preallocated buffers
(`contiguous.py`); with `cpu_checkpointing` they live in host memory (pinned on an accelerator).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .contiguous import SLOTS
from .probe import no_probe, report_held


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and asynchronous from an accelerator, a plain copy on CPU."""
    pinned = t.device.type != "cpu"
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return host


class Layout:
    """How a tensor of `shape` on `device` is split over a group of `world` ranks: flattened, padded to
    a multiple of `world`, `per` elements each."""

    def __init__(self, t: torch.Tensor, group, rank: int, world: int):
        self.shape, self.numel, self.device = t.shape, t.numel(), t.device
        self.group, self.rank, self.world = group, rank, world
        self.per = -(-self.numel // world)

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `whole` (of this layout's shape), a view where no padding is needed."""
        flat = whole.reshape(-1)
        if self.per * self.world != self.numel:
            flat = torch.nn.functional.pad(flat, (0, self.per * self.world - self.numel))
        return flat[self.rank * self.per:(self.rank + 1) * self.per]

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's piece (each of `per` elements, on this layout's device) → the whole tensor."""
        mine = mine.to(self.device, non_blocking=True)
        if self.world == 1:
            return mine[:self.numel].view(self.shape)
        pieces = [torch.empty(mine.shape, dtype=mine.dtype, device=self.device) for _ in range(self.world)]
        dist.all_gather(pieces, mine, group=self.group)
        return torch.cat(pieces)[:self.numel].view(self.shape)


def keep(layout: Layout, whole: torch.Tensor, position: int, settings):
    """This rank's slice of `whole` as it is held until backward — in a contiguous slot, in host memory,
    or a copy of its own — and the probe token for what it costs (probe.py: a packed saved tensor is
    hidden from the probe, so its owner reports it)."""
    piece = layout.piece(whole.detach())
    device = torch.device("cpu") if settings.cpu_checkpointing else whole.device
    if settings.contiguous_checkpointing:
        return SLOTS.copy_in(position, piece, settings.num_checkpoints, device)
    kept = to_host(piece) if settings.cpu_checkpointing else piece.clone()
    return kept, report_held(kept.numel() * kept.element_size())


class Partition:
    """A reentrant checkpoint's saved input, packed (module note)."""

    def __init__(self, t: torch.Tensor, layout: Layout, position: int, settings):
        self.layout = layout
        self.slice, self.token = keep(layout, t, position, settings)

    def whole(self) -> torch.Tensor:
        return self.layout.gather(self.slice)


class ToHost(torch.autograd.Function):
    """A non-reentrant region's input held in host memory (`cpu_checkpointing` without partitioning):
    `to_host` (pinned and asynchronous from an accelerator), the gradient sent back to the input's
    device. The copy is ordered on the current stream before any later use of the source's memory,
    and the recompute's copy back is ordered after it, so nothing waits on the host here."""

    delivers_gradients_once = True  # a copy or a collective, no backward of its own (engine/zero/arrivals.py)

    @staticmethod
    def forward(ctx, t):
        ctx.device = t.device
        return to_host(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device, non_blocking=True)


class Scatter(torch.autograd.Function):
    """input → the slice a non-reentrant region holds; backward all-gathers the gradient's pieces."""

    delivers_gradients_once = True

    @staticmethod
    def forward(ctx, t, layout: Layout, position: int, settings):
        ctx.layout = layout
        with no_probe():  # torch's checkpoint saves the slice as a tensor: the probe sees it itself
            kept, _ = keep(layout, t, position, settings)
        return kept

    @staticmethod
    def backward(ctx, grad_piece):
        return ctx.layout.gather(grad_piece), None, None, None


class Gather(torch.autograd.Function):
    """The slice → the whole input, inside the region; backward keeps this rank's piece."""

    delivers_gradients_once = True

    @staticmethod
    def forward(ctx, kept, layout: Layout):
        ctx.layout, ctx.kept_device = layout, kept.device
        return layout.gather(kept)

    @staticmethod
    def backward(ctx, grad_whole):
        return ctx.layout.piece(grad_whole).to(ctx.kept_device), None
