"""`pipeline.pipe_partitioned` / `pipeline.grad_partitioned`: with tensor parallelism inside a stage,
send each tensor rank's 1/T slice of what crosses a stage boundary, not T copies of the whole.

[Note: why a slice suffices] After a stage's last row-parallel all-reduce (and in its replicated
layers) every tensor rank of the stage holds the same activation, and the next stage's tensor ranks
each need all of it. Rank r of the model group is paired with rank r of the next stage (one pipe
group per model index), so rank r sends only slice r of the flattened, padded tensor and the
receiving stage rebuilds the whole with one all-gather inside its model group (pipe_partitioned). The
gradient going back is, at the receiving stage's input, the same on every tensor rank too (the
backward of its first column-parallel layer all-reduces it, as it does for any replicated input), so
the receiver sends back only slice r of it and the sending stage all-gathers the slices
(grad_partitioned). Bytes per boundary and direction drop by T; each all-gather moves the same bytes
once more, but inside the tensor group (NVLink within a node, where the pipe hop may cross nodes).
The result is bit-for-bit that of sending whole tensors: the slices are copies, the gather restores them.

Only floating-point tensors are sliced (an integer mask or token ids cross whole: small, no gradient).
Both directions ride on the same tensor shapes in torch's stages (a stage sends back a gradient of the
shape it received), so the two keys must agree when T > 1 (build.py refuses a mixed pair). Without a
model axis both keys do nothing, as in DeepSpeed.
"""
from __future__ import annotations

import torch

from ..comm import Communicator


def _piece(numel: int, parts: int) -> int:
    return -(-numel // parts)


def _slice_of(full: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    flat = full.reshape(-1)
    k = _piece(flat.numel(), parts)
    padded = torch.zeros(k * parts, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    return padded[rank * k:(rank + 1) * k].clone()


def _gathered(piece: torch.Tensor, comm: Communicator, shape: torch.Size) -> torch.Tensor:
    whole = torch.empty(piece.numel() * comm.world_size, dtype=piece.dtype, device=piece.device)
    comm.all_gather(whole, piece.contiguous())
    return whole[:shape.numel()].view(shape)


class _SendSlice(torch.autograd.Function):
    """Sending side: forward keeps this rank's slice; backward all-gathers the gradient slices."""

    @staticmethod
    def forward(ctx, full, comm):
        ctx.comm, ctx.shape = comm, full.shape
        return _slice_of(full, comm.rank, comm.world_size)

    @staticmethod
    def backward(ctx, grad_piece):
        return _gathered(grad_piece, ctx.comm, ctx.shape), None


class _ReceiveSlice(torch.autograd.Function):
    """Receiving side: forward all-gathers the slices; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, piece, comm, shape):
        ctx.comm = comm
        return _gathered(piece, comm, shape)

    @staticmethod
    def backward(ctx, grad_full):
        return _slice_of(grad_full, ctx.comm.rank, ctx.comm.world_size), None, None


def _sliced(t: torch.Tensor) -> bool:
    return t.is_floating_point()


class PartitionedWire:
    """What one chunk does at its two boundaries when the stage's tensor ranks partition the traffic."""

    def __init__(self, model_comm: Communicator):
        self.comm = model_comm
        self.shapes: tuple | None = None  # whole shapes of the received tensors (from the probe's run)

    def send(self, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(_SendSlice.apply(t, self.comm) if _sliced(t) else t for t in flat)

    def receive(self, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        assert self.shapes is not None, "the probe sets the whole shapes before the first receive"
        return tuple(_ReceiveSlice.apply(t, self.comm, shape) if shape is not None else t
                     for t, shape in zip(flat, self.shapes))


def wire_shapes(flat: tuple[torch.Tensor, ...]) -> tuple:
    """The whole shapes a receiver rebuilds (None for a tensor that crosses whole), from the sender's output."""
    return tuple(t.shape if _sliced(t) else None for t in flat)


def partitioned(pipeline_cfg, model_axis: int) -> bool:
    """Whether stage boundaries are partitioned over the model axis (the keys agree: build.py)."""
    return model_axis > 1 and pipeline_cfg.pipe_partitioned
