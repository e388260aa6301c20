"""Gradients once per pipeline step: tied weights, the data-axis reduction, and the world's norm.

[Note: one norm for the world] Each stage holds different parameters, so a gradient norm computed
by one stage's ZeRO optimizer covers only that stage. Clipping with it would scale every stage
differently (a different model than the reference), and an Inf on one stage would make only that
stage skip (the others step: divergence, or a deadlock at the next collective). So the square of
the norm each stage's optimizer agreed over its data group is summed over the model-parallel group
(pipe × model): the result is the norm of the whole model's gradient, identical on every rank of
the world. A tied weight is held by several stages with the same (summed) gradient; the stages
other than the first subtract their copy's square first, so it is counted once. The square of a
non-finite gradient is non-finite, and stays so through the sum (Inf − Inf is NaN): every rank
skips the same step without a separate flag. With tensor parallelism a replicated tied weight is
left out on tensor ranks r > 0 already (tensor_parallel/norm.py), so only tensor rank 0 subtracts
it; a vocabulary-split tied weight is subtracted on every tensor rank (each holds its own slice).

[Note: the loss rides on the norm] DeepSpeed's train_batch returns the loss on every stage, which the
last stage has to send to the others. That was a broadcast of its own after every step: one more
point where every stage waits for the slowest (on a busy host each such wait costs a wake-up). The
world's norm² is already one all-reduce over pipe × model at every step, so the loss travels as its
second element: the last stage's tensor rank 0 adds the loss, every other rank adds 0, and the sum is
the loss everywhere. When the optimizer reduces no norm (`LossRider.loss` still set after the step),
the engine broadcasts it as before. The batch's outcome rides there too, as a third element: the
count of data groups whose batch failed (stage_failure.py's note: the outcome rides on the norm); a
count above zero raises `BatchFailed` before the norm is returned to the optimizer. The three elements
are summed independently, so the norm² and the loss are the sums they were.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from ..tensor_parallel.layers import is_partitioned
from .stage_failure import BatchFailed


class TiedGradients:
    """The tied weights of one PipelineModule and their groups (created on every rank, in key order)."""

    def __init__(self, module, groups, data_comm: Communicator):
        self.data_comm = data_comm
        self.params = module.tied_parameters()
        stage = groups.coord.pipe
        self.comms = {key: Communicator(group) for key, group in module.tie_groups.items()}
        self.owner = {key: stage == module.tie_stages()[key][0] for key in self.comms}
        self.tensor_rank = groups.coord.model
        self.duplicate_square: torch.Tensor | None = None

    def all_reduce_grads(self, zero_optimizer) -> None:
        """Sum each tied weight's accumulated gradient over its tie group, where the optimizer keeps it
        (`.grad`, or a side tensor of a wider `data_types.grad_accum_dtype`: `with_accumulated_grad`)."""
        for key, comm in self.comms.items():
            for p in self.params[key]:
                zero_optimizer.with_accumulated_grad(p, comm.all_reduce)

    def measure_duplicates(self, zero_optimizer, loss_scale: float) -> None:
        """On the non-first holders: the square of the data-averaged, unscaled tied gradient (module note)."""
        sq = self.data_comm.zeros()

        def add_square(grad: torch.Tensor) -> None:
            nonlocal sq
            g = grad.detach().float().clone()
            self.data_comm.all_reduce(g)
            sq += (g / (self.data_comm.world_size * loss_scale)).square().sum()
        for key, comm in self.comms.items():
            if self.owner[key]:
                continue
            for p in self.params[key]:
                if self.tensor_rank > 0 and not is_partitioned(p):  # counted on tensor rank 0 (module note)
                    continue
                zero_optimizer.with_accumulated_grad(p, add_square)
        self.duplicate_square = sq


class LossRider:
    """The step's loss and the batch's outcome, waiting to ride on the norm's all-reduce (module note)."""

    def __init__(self):
        self.loss: torch.Tensor | None = None  # one element; the agreed loss is written into it
        self.contributes = False
        self.failed = False  # this rank's data group knows its batch failed (stage_failure.py)

    def load(self, loss: torch.Tensor | None, contributes: bool, failed: bool = False) -> None:
        self.loss, self.contributes, self.failed = loss, contributes, failed


class WorldNorm:
    """The ZeRO optimizers' `norm_reduce`: data-agreed norm² of this stage → the world's norm² (`tied`: a
    pipeline's tied weights; tensor parallelism leaves its duplicates out before, tensor_parallel/norm.py;
    `rider`: a pipeline's loss and outcome, summed in the same all-reduce, module note)."""

    def __init__(self, mp_comm: Communicator, tied: TiedGradients | None = None, rider: LossRider | None = None):
        self.mp_comm, self.tied, self.rider = mp_comm, tied, rider

    def __call__(self, square: torch.Tensor) -> torch.Tensor:
        square = square.reshape(1).float()
        if self.tied is not None and self.tied.duplicate_square is not None:
            square = square - self.tied.duplicate_square
        rider = self.rider
        if rider is None:
            self.mp_comm.all_reduce(square)
            return square
        riding = torch.cat([square, square.new_zeros(2)])  # [norm², loss, failed data groups]
        if rider.loss is not None and rider.contributes:
            riding[1:2] = rider.loss.reshape(1)
        if rider.failed:
            riding[2] = 1.0
        self.mp_comm.all_reduce(riding)
        if rider.loss is not None:
            rider.loss.copy_(riding[1:2].reshape(rider.loss.shape))
            rider.loss = None
        if riding[2].item() > 0:  # a host read the caller's float(norm) makes anyway
            raise BatchFailed()
        return riding[:1]

    def post_failure(self) -> None:
        """A data group that knows its batch failed: its part of the all-reduce, with its vote; raises
        BatchFailed (stage_failure.py's note: the outcome rides on the norm)."""
        self.rider.load(None, contributes=False, failed=True)
        self(torch.zeros(1, device=self.mp_comm.device))


def reduce_accumulated(zero_optimizer) -> None:
    """Reduce over the data axis what the schedule's backward passes accumulated, once per step (the
    schedule calls autograd itself, so no backward of the optimizer's was 'the boundary' one)."""
    zero_optimizer.reduce_accumulated()
