"""The tensor-parallel collectives a pipeline chunk posts, recorded so that a rank whose user code raised
can post the rest of them for its tensor peers.

[Note: a failure on one tensor rank] engine/pipe/stage_failure.py keeps a stage's schedule going when
its user code raises: the chunk returns zeros, the batch ends, every rank raises after it. When the
error is raised on some tensor ranks of the stage only (a check of a rank's own shard), the others
are inside the same forward or backward, waiting in its next tensor-parallel collective (a row
layer's all-reduce, a column layer's input-gradient all-reduce in the backward), which the failing
rank never posts: they waited until the process-group timeout (30 minutes under NCCL). A collective
is matched by its order and its size alone, so the failing rank can post it for them if it knows
what comes: each chunk records, per input signature (shapes and dtypes of what it receives), the
sequence (kind, shape, dtype, op) of the collectives its forward posted, and per backward kind those
of its backward, each from a run that did not raise. The rank that raised posts the rest of the
sequence with zeros (`post_rest`): its forward's after the point where it raised, and, for the
micro-batch whose forward it replaced, its whole backward's. The peers' results are then garbage of
a batch whose gradients every rank drops; what they wait for arrives, so every rank reaches the vote.
The record costs a list append per collective. A chunk has no record before its first run with that
signature that raised nowhere: the probe's forward (probe.py) records the forward before any schedule; a
backward kind's record, and the loss's, is made by the first micro-batch's. A run with no record is
guarded (`guarded`, `guarding`): each tensor-parallel collective is preceded by a round, a one-int
all-reduce over the model group (MAX, `agree`), and the run ends with one more. A rank whose user code
raised posts a 1 in the round it did not reach; a rank that already knows the batch failed (its forward
raised at micro-batch 0 of the shape's first schedule, a peer's 1 reached it) has nothing to post from:
it posts a 1 at once and skips the run. The peers meet the 1 at their next round, before their next
collective or at the run's end, and raise `TensorPeerFailed` there: every tensor rank of the stage stops
the run at the same point, knows the batch failed, and makes no record, so the tensor ranks' records
always have the same keys and guard the same runs. Where: the probe's forward (it fails on every tensor
rank), the first backward of each kind of a signature (pipe/tensor_peers.py: a peer that met the 1
skips the batch's later backward passes as after an error of its own; a later one with a record is
posted whole by each rank that knows, `post_rest`, one without posts a 1 again), and the loss's first
run. Cost: one extra all-reduce of one int per collective of those runs (a host sync each on a GPU),
once per signature, again only after a run of it failed.
Only the collectives of engine.tensor_parallel are recorded (mappings.py, region_params.py's summing
hooks, cross_entropy.py): a user's own collective over the model group inside a chunk is not. The last
stage's loss_fn is recorded too, per signature of the outputs it reads (a vocab-parallel cross-entropy
all-reduces there, pipe/tensor_peers.py's `ledgered_loss`): one raising before them left its peer's all-reduce to meet
the failing rank's next posts, a mismatched collective (gloo aborted the process).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


class Posted(NamedTuple):
    kind: str  # "all_reduce" or "all_gather"
    comm: object  # the Communicator it went through
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    op: object  # the all-reduce's ReduceOp, None for a gather


class TensorPeerFailed(RuntimeError):
    """Another tensor rank of this stage raised in user code run guarded (module note); that rank's error
    is the one the pipeline reports."""


class _Recording:
    """The list the collectives go to now, and the model group's Communicator while a run is guarded:
    process-wide, not per thread, since a CUDA backward runs in autograd's device thread (the schedule
    runs one chunk's forward or backward at a time)."""

    posted: list | None = None
    guard = None


_NOW = _Recording()


def note(kind: str, comm, tensor: torch.Tensor, op=None) -> None:
    """Called by each tensor-parallel collective before it posts (module note)."""
    if _NOW.posted is not None and comm.world_size > 1:
        _NOW.posted.append(Posted(kind, comm, tuple(tensor.shape), tensor.dtype, tensor.device, op))
    if _NOW.guard is not None and comm.world_size > 1:
        agree(_NOW.guard, False)


def agree(comm, failed: bool) -> None:
    """One round of a guarded run (module note): this rank's flag, MAX over the model group `comm`; raises
    TensorPeerFailed on a rank that posted 0 where a peer posted 1."""
    flag = torch.full((1,), int(failed), dtype=torch.int64, device=comm.device)
    comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if int(flag.item()) and not failed:
        raise TensorPeerFailed("another tensor rank of this stage raised in the first run of this input shape's "
                               "forward, backward or loss; its error is reported with the stage's")


@contextlib.contextmanager
def guarding(comm):
    """Each tensor-parallel collective inside is preceded by a round (module note); the caller posts the
    last one. For a backward, whose errors torch's stage catches before they reach a context manager."""
    outer, _NOW.guard = _NOW.guard, comm
    try:
        yield
    finally:
        _NOW.guard = outer


@contextlib.contextmanager
def guarded(comm):
    """A guarded run over the model group `comm` (module note; None: not guarded): raises
    TensorPeerFailed where a tensor peer raised; an error of this rank's own is told to the peers before it
    leaves."""
    if comm is None or comm.world_size == 1:
        yield
        return
    try:
        with guarding(comm):
            yield
    except TensorPeerFailed:
        raise
    except BaseException:
        agree(comm, True)
        raise
    agree(comm, False)  # the run's end


@contextlib.contextmanager
def recording():
    """The collectives posted inside, as a list (module note)."""
    outer, _NOW.posted = _NOW.posted, []
    try:
        yield _NOW.posted
    finally:
        _NOW.posted = outer


def post_rest(recorded: list | None, done: int) -> None:
    """Post zeros for the collectives of `recorded` after the first `done` (module note). Nothing when
    nothing was recorded for this signature."""
    for p in (recorded or [])[done:]:
        buf = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if p.kind == "all_reduce":
            p.comm.all_reduce(buf, op=p.op)
        else:
            p.comm.all_gather(torch.empty((p.comm.world_size, *p.shape), dtype=p.dtype, device=p.device), buf)


def signature(tensors) -> tuple:
    """What a chunk's collectives' sizes depend on: the shapes and dtypes it receives."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in tensors)
