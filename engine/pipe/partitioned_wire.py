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

[Note: the wire is the stage's, not the model's] The slicing happens on what torch's stage hands to
its sends and takes from its receive buffers (`LoggedStage`, schedule.py), never inside autograd:
the chunk's layers and autograd always see whole tensors, and each direction is sliced or not on
its own, so the keys are independent, as in DeepSpeed (activations sliced while gradients go whole,
or the reverse). The stage's receive buffers are built at the sliced shapes (`buffer_examples`).

Only floating-point tensors are sliced (an integer mask or token ids cross whole: small, no gradient).
Without a model axis both keys do nothing, as in DeepSpeed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Communicator


def _piece(numel: int, parts: int) -> int:
    return -(-numel // parts)


def _slice_of(full: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    flat = full.detach().reshape(-1)
    k = _piece(flat.numel(), parts)
    padded = torch.zeros(k * parts, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    return padded[rank * k:(rank + 1) * k].clone()


def _sliced(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_floating_point()


class PartitionedWire:
    """What one stage does at its boundaries when its tensor ranks partition the traffic of one or
    both directions (module notes). `in_shapes`/`out_shapes`: the whole shapes of what the stage
    receives and produces (from the probe's examples, probe.py)."""

    def __init__(self, model_comm: Communicator, activations: bool, gradients: bool):
        self.comm, self.activations, self.gradients = model_comm, activations, gradients
        self.in_shapes: tuple = ()
        self.out_shapes: tuple = ()

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        return _slice_of(t, self.comm.rank, self.comm.world_size)

    def _gather(self, piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        whole = torch.empty(piece.numel() * self.comm.world_size, dtype=piece.dtype, device=piece.device)
        self.comm.all_gather(whole, piece.detach().contiguous())
        return whole[:shape.numel()].view(shape)

    def outgoing(self, ops: list, sliced: bool) -> list:
        """torch's send ops with each floating-point tensor replaced by this rank's slice (`sliced`)."""
        if not sliced:
            return ops
        return [dist.P2POp(op.op, self._slice(op.tensor), op.peer, op.group, op.tag) if _sliced(op.tensor) else op
                for op in ops]

    def activations_in(self, received: tuple) -> tuple:
        """The whole activations, as leaves with the received buffers' requires_grad."""
        if not self.activations:
            return received
        return tuple(self._gather(t, shape).requires_grad_(t.requires_grad) if _sliced(t) else t
                     for t, shape in zip(received, self.in_shapes))

    def gradients_in(self, received: tuple) -> tuple:
        """The whole gradients of the stage's outputs."""
        if not self.gradients:
            return received
        return tuple(self._gather(g, shape) if _sliced(g) else g for g, shape in zip(received, self.out_shapes))

    def buffer_examples(self, inputs: tuple, outputs: tuple, receives: bool, sends: bool) -> dict:
        """The stage's example keywords for torch: receive buffers at the sliced shapes, the stage's
        inputs and outputs whole otherwise (module note)."""
        self.in_shapes = tuple(t.shape for t in inputs)
        self.out_shapes = tuple(t.shape for t in outputs)
        stand_in = (lambda t: self._slice(t).requires_grad_(t.requires_grad) if _sliced(t) else t)
        kwargs = {"input_args": tuple(map(stand_in, inputs)) if receives and self.activations else inputs,
                  "output_args": outputs}
        if receives and self.activations:  # what it sends back: gradients of the whole inputs
            kwargs["input_grads"] = tuple(torch.zeros_like(t, device=t.device) if t.requires_grad else None
                                          for t in inputs)
        if sends and self.gradients:  # what it receives back: slices of its outputs' gradients
            kwargs["output_grads"] = tuple(self._slice(t) if t.requires_grad else None for t in outputs)
        return kwargs


def partitioned(pipeline_cfg, model_axis: int) -> bool:
    """Whether a stage boundary is partitioned over the model axis in either direction."""
    return model_axis > 1 and (pipeline_cfg.pipe_partitioned or pipeline_cfg.grad_partitioned)
