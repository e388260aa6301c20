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

[Note: a boundary that is not replicated] The note above fails where a stage ends inside a tensor-
parallel pair: a ColumnParallelLinear(gather_output=False) whose RowParallelLinear(input_is_parallel=
True) is on the next stage hands on each tensor rank's own shard of the activation (and its gradient
coming back is a shard too). Slicing it would make every receiver rebuild a mix of the ranks' shards.
So once per built boundary (a new input signature, probe.py) each stage compares checksums of the bit
patterns of the probe's floating-point tensors at its boundaries over its model group (one all-gather
of two int64 per tensor); a boundary where any of them differs between tensor ranks crosses whole in
both directions. Sender and receiver decide alike: the receiver's probe examples are the sender's
outputs. A shard that happens to be equal on every rank for the probe's micro-batch (a column-parallel
layer initialised to zeros) would be taken as replicated: set both keys to false for such a model.

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


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `t`'s bit patterns, plain and weighted by position: equal where the bits are."""
    bits = t.detach().reshape(-1).contiguous().view(_BITS[t.element_size()]).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * weights).sum()])


class PartitionedWire:
    """What one stage does at its boundaries when its tensor ranks partition the traffic of one or
    both directions (module notes). `in_shapes`/`out_shapes`: the whole shapes of what the stage
    receives and produces (from the probe's examples, probe.py)."""

    def __init__(self, model_comm: Communicator, activations: bool, gradients: bool):
        self.comm, self.activations, self.gradients = model_comm, activations, gradients
        self.in_shapes: tuple = ()
        self.out_shapes: tuple = ()
        # per direction and boundary, whether it crosses sliced (buffer_examples: a boundary that is not
        # replicated over the tensor ranks crosses whole, module note)
        self.activations_sent = self.activations_received = activations
        self.gradients_sent = self.gradients_received = gradients

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
        if not self.activations_received:
            return received
        return tuple(self._gather(t, shape).requires_grad_(t.requires_grad) if _sliced(t) else t
                     for t, shape in zip(received, self.in_shapes))

    def gradients_in(self, received: tuple) -> tuple:
        """The whole gradients of the stage's outputs."""
        if not self.gradients_received:
            return received
        return tuple(self._gather(g, shape) if _sliced(g) else g for g, shape in zip(received, self.out_shapes))

    def _replicated(self, inputs: tuple, outputs: tuple) -> tuple[bool, bool]:
        """Whether every floating-point tensor of `inputs`, of `outputs`, holds the same bits on all
        tensor ranks (module note: one all-gather of checksums over the model group)."""
        tensors = [t for t in inputs + outputs if _sliced(t)]
        if not tensors:
            return True, True
        mine = torch.stack([_checksum(t) for t in tensors])
        every = torch.empty((self.comm.world_size, *mine.shape), dtype=mine.dtype, device=mine.device)
        self.comm.all_gather(every, mine)
        same = (every == every[0]).all(dim=2).all(dim=0).tolist()
        n_in = sum(_sliced(t) for t in inputs)
        return all(same[:n_in]), all(same[n_in:])

    def buffer_examples(self, inputs: tuple, outputs: tuple, receives: bool, sends: bool) -> dict:
        """The stage's example keywords for torch: receive buffers at the sliced shapes, the stage's
        inputs and outputs whole otherwise (module notes). Collective over the model group."""
        self.in_shapes = tuple(t.shape for t in inputs)
        self.out_shapes = tuple(t.shape for t in outputs)
        in_same, out_same = self._replicated(inputs if receives else (), outputs if sends else ())
        self.activations_received, self.gradients_sent = self.activations and in_same, self.gradients and in_same
        self.activations_sent, self.gradients_received = self.activations and out_same, self.gradients and out_same
        stand_in = (lambda t: self._slice(t).requires_grad_(t.requires_grad) if _sliced(t) else t)
        acts_in = receives and self.activations_received
        kwargs = {"input_args": tuple(map(stand_in, inputs)) if acts_in else inputs, "output_args": outputs}
        if acts_in:  # what it sends back: gradients of the whole inputs
            kwargs["input_grads"] = tuple(torch.zeros_like(t, device=t.device) if t.requires_grad else None
                                          for t in inputs)
        if sends and self.gradients_received:  # what it receives back: slices of its outputs' gradients
            kwargs["output_grads"] = tuple(self._slice(t) if t.requires_grad else None for t in outputs)
        return kwargs


def partitioned(pipeline_cfg, model_axis: int) -> bool:
    """Whether a stage boundary is partitioned over the model axis in either direction."""
    return model_axis > 1 and (pipeline_cfg.pipe_partitioned or pipeline_cfg.grad_partitioned)
