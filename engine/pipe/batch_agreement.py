"""What every rank of a pipeline learns before a batch runs: the batch's input signature, and whether
any reader's data iterator ran out.

[Note: one agreement per batch] Only the first and the last stage of each data-parallel replica read
the data iterator (inputs at the first, labels to the loss at the last). What they find must reach
every other rank before any rank enters one of the batch's collectives, or a rank that went on waits
for a message that never comes: a middle stage in its first receive, the first stage when only the
last stage's iterator ran out (or the reverse), the other replicas in the data axis's gradient
reduction when one replica's iterator is shorter. (DeepSpeed waits there until the NCCL timeout.)
The readers pull all m micro-batches before the schedule starts (the schedule takes them as one
list anyway), so the check needs no message per micro-batch: after the pull, every rank of the world
takes part in one all-reduce (MAX) of int64s, `1 + data × model` of them:
- [0]: −(p·W + r) from a reader of global rank r that pulled only p < m micro-batches (W: the world
  size), −m·W from every other rank: the maximum names the fewest micro-batches pulled, and the rank;
  a reader whose iterator raised (a DataLoader worker's error, a malformed batch), or a first stage whose
  batch has no key (a namedtuple: torch cannot serialise its tree spec), votes p = −1, which
  outranks running out: it raises its own error, every other rank a `DataReadFailed` naming it;
- [1 + g]: pipe group g's batch key (its first stage's input-signature fingerprint, ≥ 0, or
  MIXED_BATCH), the int64 minimum from every other rank: each rank reads its own group's.
Every rank decides from the same vector, so all raise, or none: `DataExhausted` before anything ran
(no gradient accumulated, no counter moved, nothing half-issued), a mixed batch's ValueError likewise.
It replaces the per-batch broadcast of the key over the pipe group (the other one a step adds: the
norm's all-reduce, which the loss and the schedule's outcome ride on, reduction.py, stage_failure.py). What it
costs over that broadcast: the first stage, which did not wait for the broadcast to be received, now
starts its first forward only once every rank has finished the previous step. The norm's all-reduce
over pipe × model lined the world up then, to within the ranks' optimizer steps, so per step that is
at most the shorter of that lag and the first stage's warm-up forwards, plus one small all-reduce
(docs/parallelism.md: below this machine's noise). The alternative — the first stage starting
before it knows — cannot be undone: its sends would be posted to stages about to raise.
"""
from __future__ import annotations

import torch

from ..comm import Communicator

MIXED_BATCH = -1  # a first stage's key: its micro-batches differ in nest or shape
READ_FAILED = -1  # a reader's `pulled` when its iterator raised (module note)
_NO_KEY = torch.iinfo(torch.int64).min  # what a rank that is no first stage contributes to a key's slot


class DataExhausted(StopIteration):
    """train_batch/eval_batch's data iterator ran out. A StopIteration, as DeepSpeed's (whose stages that
    read data let the iterator's own escape), so a loop that stops on it keeps working; unlike DeepSpeed's,
    it is raised on every rank of the pipeline — the stages that read no data and the other data-parallel
    replicas included — before the batch changed anything (module note)."""


class DataReadFailed(RuntimeError):
    """Another rank's data iterator raised; that rank raises the error itself (module note)."""


def agree_on_batch(world: Communicator, groups, key: int | None, pulled: int | None, m: int) -> int:
    """This rank's pipe group's batch key, once the world agreed the batch can run (module note).
    `key`: this rank's, on a first stage (else None); `pulled`: the micro-batches this reader got when its
    iterator ran out, READ_FAILED when it raised (else None). Raises DataReadFailed, DataExhausted or
    ValueError on every rank alike."""
    topo, coord = groups.topology, groups.coord
    size = world.world_size
    votes = torch.full((1 + topo.data * topo.model,), _NO_KEY, dtype=torch.int64, device=world.device)
    votes[0] = -(pulled * size + groups.rank) if pulled is not None else -m * size
    if key is not None:
        votes[1 + coord.data * topo.model + coord.model] = key
    world.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
    votes = votes.tolist()  # one host copy for all the checks
    fewest, rank = divmod(-votes[0], size)
    if fewest == READ_FAILED:
        where = topo.coord(rank)
        raise DataReadFailed(f"stage {coord.pipe}: the data iterator of rank {rank} (stage {where.pipe}, "
                             f"data-parallel rank {where.data}) raised (its error is in that rank's output); "
                             "every rank stops here, nothing of the batch ran")
    if fewest < m:
        raise _ran_out(coord.pipe, fewest, m, rank, topo.coord(rank))
    if MIXED_BATCH in votes[1:]:
        raise ValueError("the micro-batches of one train_batch/eval_batch differ in nest or shape; a pipeline "
                         "sizes its buffers per batch, so give one batch's micro-batches equal shapes "
                         "(e.g. bucket sequences by length)")
    return votes[1 + coord.data * topo.model + coord.model]


def _ran_out(stage: int, pulled: int, m: int, rank: int, where) -> DataExhausted:
    return DataExhausted(f"stage {stage}: the pipeline's data iterator ran out after {pulled} of the {m} "
                         f"micro-batches (gradient_accumulation_steps) of this train_batch/eval_batch on rank "
                         f"{rank} (stage {where.pipe}, data-parallel rank {where.data}); every rank stops here, "
                         "nothing of the batch ran; pass a new iterator for the next epoch (train_batch() without "
                         "one repeats the training_data loader of engine.initialize)")
