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
signature: the probe's forward (probe.py) records the forward before any schedule; the backward is
recorded by the first micro-batch's backward, so a forward that raises on micro-batch 0 of the first
schedule of a signature leaves its peers waiting in that micro-batch's backward (DSTRAIN_TIMEOUT ends
them). The probe's forward has no record to go by: there each tensor-parallel collective is preceded by
a one-int all-reduce over the model group (MAX), and the forward ends with one more (`guarded`). A rank
whose probe forward raised posts a 1 in its place (`guarded`): the peers meet it at their next such
all-reduce, before their next collective or at the forward's end, and raise `TensorPeerFailed` there,
so the probe fails on every tensor rank at the same point. Cost: one extra all-reduce of one int per
collective of the probe's forward, once per input signature.
Only the collectives of engine.tensor_parallel are recorded (mappings.py, region_params.py's summing
hooks, cross_entropy.py): a user's own collective over the model group inside a chunk is not. The last
stage's loss_fn is recorded too, per signature of the outputs it reads (a vocab-parallel cross-entropy
all-reduces there, pipe/engine.py's `_loss`): one raising before them left its peer's all-reduce to meet
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
    """Another tensor rank of this stage raised in the probe's forward (module note); that rank's error is
    the one the pipeline reports."""


class _Recording:
    """The list the collectives go to now, and the model group's Communicator while a probe's forward is
    guarded: process-wide, not per thread, since a CUDA backward runs in autograd's device thread (the
    schedule runs one chunk's forward or backward at a time)."""

    posted: list | None = None
    guard = None


_NOW = _Recording()


def note(kind: str, comm, tensor: torch.Tensor, op=None) -> None:
    """Called by each tensor-parallel collective before it posts (module note)."""
    if _NOW.posted is not None and comm.world_size > 1:
        _NOW.posted.append(Posted(kind, comm, tuple(tensor.shape), tensor.dtype, tensor.device, op))
    if _NOW.guard is not None and comm.world_size > 1:
        _agree(_NOW.guard, 0)


def _agree(comm, failed: int) -> None:
    flag = torch.full((1,), failed, dtype=torch.int64, device=comm.device)
    comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if int(flag.item()) and not failed:
        raise TensorPeerFailed("another tensor rank of this stage raised in the probe's forward (the first batch of "
                               "this input shape); its error is reported with the stage's")


@contextlib.contextmanager
def guarded(comm):
    """A probe's forward over the model group `comm` (module note): raises TensorPeerFailed where a tensor
    peer raised; an error of this rank's own is told to the peers before it leaves."""
    if comm is None or comm.world_size == 1:
        yield
        return
    outer, _NOW.guard = _NOW.guard, comm
    try:
        yield
        _NOW.guard = outer
        _agree(comm, 0)  # the forward's end
    except TensorPeerFailed:
        raise
    except BaseException:
        _NOW.guard = outer
        _agree(comm, 1)
        raise
    finally:
        _NOW.guard = outer


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
