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
schedule of a signature leaves its peers waiting in that micro-batch's backward, and one raised in the
probe itself in the probe's forward, as before (DSTRAIN_TIMEOUT ends them).
Only the collectives of engine.tensor_parallel are recorded (mappings.py, region_params.py's summing
hooks, cross_entropy.py): a user's own collective over the model group inside a chunk is not.
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


class _Recording:
    """The list the collectives go to now: process-wide, not per thread, since a CUDA backward runs in
    autograd's device thread (the schedule runs one chunk's forward or backward at a time)."""

    posted: list | None = None


_NOW = _Recording()


def note(kind: str, comm, tensor: torch.Tensor, op=None) -> None:
    """Called by each tensor-parallel collective before it posts (module note)."""
    if _NOW.posted is not None and comm.world_size > 1:
        _NOW.posted.append(Posted(kind, comm, tuple(tensor.shape), tensor.dtype, tensor.device, op))


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
