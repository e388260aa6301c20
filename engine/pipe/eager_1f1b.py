"""`pipeline.schedule: "eager_1f1b"`: 1F1B with each stage one micro-batch further ahead of the next.

[Note: why eager] In 1F1B stage s runs p − s forwards before its first backward, then alternates. With
balanced stages that leaves no slack at a boundary: stage s + 1 needs activation k + 1 right after
its backward k, and stage s computes that activation only after its own backward k − 1, which needs
the gradient stage s + 1 sent after its backward k − 1. So every micro-batch of the steady state waits
for one round trip, a send and a wake-up each way (on 2 stages, 2 latencies per micro-batch on each
stage: with the stages' compute C per micro-batch the period is C + 2L, not C). Here stage s runs
2(p − s) − 1 forwards first (the last stage still 1, each stage one more than the next's count plus
one), so activation k + 1 is sent a whole micro-batch before it is needed and the gradient's trip is
hidden behind the forward that follows the backward: the period is C again. The bubble formula is
1F1B's, (p − 1)/(m + p − 1) (the extra forwards move idle time, they do not add it), and stage s holds
up to 2(p − s) − 1 micro-batches of activations instead of p − s (the test measures both).

[Note: gloo only] Every send is posted as soon as its tensor exists and waited for only at the end of
the step (completed ones are dropped as it goes), so stage s's sends of the extra activations are
outstanding while it waits for a gradient. gloo moves each message on its own, so that is safe. NCCL
runs the point-to-point operations between two ranks on one stream in posting order: stage s + 1
posts its receive of activation k + 1 after its send of gradient k, stage s posts the send of
activation k + 1 before its receive of gradient k, and each waits on the other: a deadlock. So the
schedule is refused on any other backend (schedule.py), where "1f1b" fuses those two posts as torch's
Schedule1F1B does.
"""
from __future__ import annotations

from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

from .stage_loop import StageLoop


def eager_lead(stage_index: int, num_stages: int, m: int) -> int:
    """Forwards stage `stage_index` runs before its first backward (module note)."""
    return min(m, 2 * (num_stages - stage_index) - 1)


class Eager1F1B(StageLoop):
    """One stage per rank; torch's stage does the computing and the messages, this orders them."""

    def _loop(self) -> None:
        stage, m = self._stage, self._n_microbatches
        sends: list = []

        def post(ops) -> None:
            sends[:] = [work for work in sends if not work.is_completed()]
            sends.extend(_batch_p2p(ops))

        def forward(k: int) -> None:
            _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(k)))
            post(self._forward(k))

        def backward(k: int) -> None:
            _wait_batch_p2p(_batch_p2p(stage.get_bwd_recv_ops(k)))
            post(self._backward(k))

        lead = eager_lead(stage.stage_index, self._num_stages, m)
        for k in range(lead):
            forward(k)
        for k in range(m):
            if self._has_backward:
                backward(k)
            if k + lead < m:
                forward(k + lead)
        _wait_batch_p2p(sends)
