"""An error raised inside the schedule on one stage stops every rank of the world, each naming it.

[Note: a failing stage keeps the schedule's sends] Inside torch's schedule every stage waits for its
neighbours' activations and gradients. A stage whose user code raised (the loss_fn on the last stage,
a layer's forward on any stage) and let the error escape posted none of its remaining sends: the
stage before it waited for a gradient, the one after for an activation, and the rest of the world in
the next collective, until dslaunch or the process-group timeout ended the job (30 minutes under
NCCL), with the error in one rank's log. Interrupting the others' waits from outside (aborting the
process group) is not something NCCL supports cleanly and would leave the job without a group. So the
failing stage keeps its part of the schedule: the error is kept, and in its place the chunk returns
zeros shaped as the probe's outputs (probe.py), the loss hook a zero loss, both attached to the graph
(zero times the inputs or parameters) so the backward passes still run and send zeros. Every stage
finishes the batch's schedule; then one all-reduce of one int64 over the world (this rank's global
rank if it failed, −1 if not; MAX) tells every rank whether, and where. If any stage failed, each
rank drops the batch's gradients (nothing steps, no counter moves) and raises: the failing rank its
own error, every other rank a `StageFailed` naming the failing stage, its rank and the error (the
text comes in one all_gather_object, only then).
A forward that raises in the probe (the first batch of each new input shape) runs no schedule at all
(probe.py's note) and is told to the world by the same all-reduce.

[Note: a failing backward] User code also runs inside autograd: a custom Function's backward, a hook
on a tensor or parameter, a module's backward hook, an activation checkpoint's recomputed forward. An
error there escapes torch's stage from its one backward entry point (`backward_maybe_with_nosync`:
full backward, or zero-bubble's input- and weight-gradient halves), before the stage cached the input
gradients it owes the previous stage. So LoggedStage (schedule.py) catches it there, keeps it (torch
wraps it in a RuntimeError "Failed to run stage backward"; the user's own error is kept, its cause),
and returns no input gradients: torch's send then posts zeros shaped as each input (what it does for
an input that got no gradient), so the previous stage receives what it waits for. From then on this
rank's backward calls of the batch run no autograd and return the same (`skipped_backward`): a
weight-gradient half after its failed input half has no graph to run on, and the batch's gradients
are dropped anyway. Gradients the failed pass had accumulated before it raised go with the rest.

User code that raises on some tensor ranks of a stage and not on the others (a check of a rank's own
shard) would leave its tensor peers in the stage's next tensor-parallel collective, which the failing
rank never posts: the failing rank posts them from what the chunk recorded
(tensor_parallel/collective_ledger.py's note, tensor_peers.py; in a run with no record yet, the probe's
forward and an input shape's first backward of each kind and first loss, each collective is guarded by a
one-int all-reduce instead). Code that raises alike on every tensor rank of the stage needs none of that
(checked by hand, with and without pipeline.pipe_partitioned/grad_partitioned).

[Note: the outcome rides on the norm] In train_batch that all-reduce of its own was a third point per
step where every rank waits for the slowest, right after the schedule, on the path from the first
stage's last backward to its next forward (on this 2-core machine, under load, 0.5-4.5 ms of waiting
each: docs/pipeline_measurements.md, 2026-12-07). The step's norm² all-reduce over pipe × model
(reduction.py's note) follows it on every rank, so the vote travels there instead, as one more float
(the count of data groups that failed: exact for any world a float32 counts). What makes that safe is
which ranks may run what before it:
- a rank *knows* its batch failed when its own user code raised, a tensor peer's did in a collective it
  shared, or its pipe group's probe failed (no schedule ran); the ranks of one data group agree on
  that first (`failed_in_data_group`: one all-reduce over the data axis, none when it has one rank),
  since all of them run the data axis's reductions or none;
- a data group that knows skips what only it takes part in (the data axis's reductions, the
  optimizer's step) and posts what crosses groups: the tied weights' sums (their tie group spans
  stages, which may not know) and the norm's all-reduce, with its vote (`BatchFailed` at once);
- a data group that does not know runs its step as usual up to that all-reduce, which raises
  `BatchFailed` inside the optimizer's step, before the guard, the clipping and the update saw the
  norm: what the reductions before it wrote the engine drops with the rest of the batch's gradients.
Then every rank calls `raise_failure`, whose one all_gather_object names the failing rank (the
highest-numbered one that raised, as the vote's MAX did). (A 1-bit optimizer, which may reduce no
norm over the pipeline in a step, is refused with a pipeline: pipe/engine.py.) Under PowerSGD
(`gradient_compression`, stage 0) a data group must not reduce a batch another one failed: its error
feedback and warm-start Q keep what each reduction saw, so the dropped batch's gradient reached the
next steps (1e-3 on an 8x8 weight, tests/test_pipeline_stage_failure.py); so wherever the optimizer's
`reductions_keep_state` says so, the outcome is voted over the world before the reductions
(`agree_on_outcome`, as eval_batch does).

[Note: a step failing on one stage] With the optimizer on NVMe a rank's step itself can fail (a swap
file's read or write), after the norm's all-reduce that carried the vote above. Without a pipeline the
data group agrees on it before the parameters' gather (zero/partitioned.py's and zero/stage3.py's notes:
a step failed on some rank): the ranks that applied the step undo it and every rank raises. Under a
pipeline the other stages never heard of it: they applied the batch and trained on while the failing
stage had undone its own. No collective crosses the stages between the step and the parameters' gather,
so the step's status all-gather is made over the world instead (`step_status_comm`, set by the pipeline
engine): every rank of every stage learns which ranks failed, the others undo and raise PeerStepError,
the failing ones their own error, and the engine moves no counter. At ZeRO-1/2 that gather replaces the
data group's (one int32 per rank of the world instead of the data group); at ZeRO-3, whose data group
agrees in the persistent refresh, it is one tiny all-gather more per step (optimizer on NVMe only).

Cost: per train_batch nothing on one data-parallel replica (the vote is a float in an all-reduce
the step makes anyway), one all-reduce over the data axis with several (over the world under
PowerSGD); per eval_batch the world's all-reduce; the schedule's micro-batches add nothing (a try around user code).
"""
from __future__ import annotations

import torch

from ..tensor_parallel.collective_ledger import TensorPeerFailed


class StageFailed(RuntimeError):
    """Another stage's user code raised inside the schedule; that rank raises the error itself."""


class FailureRecord:
    """The first error user code raised on this rank during one schedule run; `in_backward`: whether one
    was raised in a backward pass (the rank's later backward calls are skipped: module note)."""

    def __init__(self):
        self.error: BaseException | None = None
        self.phase = ""  # ", in a backward pass" when the kept error was raised in one
        self.in_backward = False
        self.peer_failed = False  # a tensor peer raised in a guarded run (tensor_parallel/collective_ledger.py)
        self.no_schedule = False  # this pipe group's probe failed: no schedule ran (probe.py)

    @property
    def known(self) -> bool:
        """Whether this rank knows the batch failed (module note: the outcome rides on the norm)."""
        return self.error is not None or self.peer_failed or self.no_schedule

    def keep(self, error: BaseException) -> None:
        if isinstance(error, TensorPeerFailed):  # another tensor rank's error, which the vote names
            self.peer_failed = True
        elif self.error is None:
            self.error = error

    def keep_backward(self, error: BaseException) -> None:
        """An error out of torch's backward entry point: the user's own error is kept (module note)."""
        cause = error.__cause__
        if isinstance(error, RuntimeError) and "Failed to run stage backward" in str(error) and cause is not None:
            error = cause
        if self.error is None and not isinstance(error, TensorPeerFailed):  # a peer's: not this rank's error
            self.phase = ", in a backward pass"
        self.keep(error)
        self.in_backward = True


def skipped_backward(bwd_kwargs: dict) -> tuple:
    """What torch's backward entry point returns for a backward that did not run: no gradient for any
    input (torch sends zeros in their place) and no parameter groups (module note: a failing backward)."""
    return tuple(None for _ in bwd_kwargs.get("input_values", ())), None


def _anchor(tensors) -> torch.Tensor | None:
    """Zero, attached to the graph of the tensors that need a gradient (None if none does). Multiplied
    before the sum, so each tensor's gradient is a dense zero tensor: the sum's alone is an expanded
    scalar, which a stage sends as is and gloo refuses (zero_bubble's input-gradient step)."""
    attached = [(t * 0).sum() for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum(attached[1:], attached[0]) if attached else None


def substitute_outputs(examples: tuple, inputs: tuple, params) -> tuple:
    """Zeros shaped as the chunk's outputs, attached to its inputs or parameters (module note)."""
    anchor = _anchor(list(inputs)) if torch.is_grad_enabled() else None
    if anchor is None and torch.is_grad_enabled():
        anchor = _anchor(list(params))
    out = []
    for example in examples:
        zeros = torch.zeros(example.shape, dtype=example.dtype, device=example.device)  # contiguous: sent as is
        if anchor is not None and example.is_floating_point() and example.requires_grad:
            zeros = zeros + anchor.to(zeros.dtype)
        out.append(zeros)
    return tuple(out)


def substitute_loss(flat_output) -> torch.Tensor:
    """A zero loss attached to the last chunk's outputs (module note)."""
    anchor = _anchor(list(flat_output))
    if anchor is not None:
        return anchor
    return torch.zeros((), device=next(t.device for t in flat_output if isinstance(t, torch.Tensor)))


class BatchFailed(Exception):
    """The norm's all-reduce said a data group's batch failed (module note: the outcome rides on the
    norm); the engine drops the batch and calls `raise_failure`."""


def failed_in_data_group(data, failure: FailureRecord) -> bool:
    """Whether any rank of this data group knows its batch failed; every rank of the group gets the same
    answer (module note). `data`: the data axis's Communicator; no collective when it has one rank."""
    if data.world_size == 1:
        return failure.known
    vote = torch.full((1,), int(failure.known), dtype=torch.int64, device=data.device)
    data.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    return bool(vote.item())


def agree_on_outcome(world, groups, failure: FailureRecord) -> None:
    """After the schedule: every rank learns whether a stage failed; if one did, every rank raises (module
    note). The caller drops the batch's gradients first."""
    vote = torch.full((1,), groups.rank if failure.error is not None else -1, dtype=torch.int64,
                      device=world.device)
    world.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    if int(vote.item()) >= 0:
        raise_failure(world, groups, failure)


def raise_failure(world, groups, failure: FailureRecord) -> None:
    """Once every rank knows a stage failed: the failing rank raises its own error, every other rank a
    StageFailed naming it (the highest-numbered rank that raised, when several did). Collective over the
    world (one all_gather_object of each rank's one-line error, or None)."""
    mine = failure.error
    texts = world.all_gather_object(None if mine is None else
                                    f"{failure.phase}: {type(mine).__name__}: {mine}".split("\n")[0])
    if mine is not None:
        mine.add_note(f"stage {groups.coord.pipe} (rank {groups.rank}){failure.phase}: every rank of the pipeline "
                      "stopped after this batch's schedule; its gradients were dropped, no step was taken")
        raise mine
    failed = max(rank for rank, text in enumerate(texts) if text is not None)
    where = groups.topology.coord(failed)
    tensor = f", tensor rank {where.model}" if groups.topology.model > 1 else ""
    raise StageFailed(f"stage {groups.coord.pipe}: stage {where.pipe} (rank {failed}, data-parallel rank "
                      f"{where.data}{tensor}) raised inside the schedule{texts[failed]}; every rank stops here, the "
                      "batch's gradients were dropped and no step was taken")
