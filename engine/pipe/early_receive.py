"""Receives posted one micro-batch ahead on a one-chunk-per-rank schedule (1F1B, GPipe).

[Note: why post early] gloo moves a message once both sides have posted it: a send that finds the
peer's receive posted writes the data in the sending thread, a send posted first only announces
itself and its data leaves when the receive is posted. torch's schedules post a stage's receive for
micro-batch k only when they are about to use it (in 1F1B, fused with the send of the previous
backward's gradient), and wait on each batch of posts, sends included. So on a 2-stage 1F1B the
first stage's send of activation k + 1 could not complete before the last stage — the steady state's
critical path — had finished backward k and posted, and the first stage waited 4-13 ms of each
25-35 ms micro-batch (benchmarks/results/2026-12-02-pipe3-timeline.txt). Posted as soon as
micro-batch k's own receive has completed, the receive of k + 1 is pending when its send comes, the
transport fills it while the stage computes, and the schedule's later post is skipped
(`get_*_recv_ops` return nothing).

Safe because each (direction, peer) carries one ordered stream: with one chunk per rank a stage
receives activations only from the previous stage and gradients only from the next, in micro-batch
order, into per-micro-batch buffers (torch allocates `args_recv_info` / `grad_recv_info` per chunk),
so an early receive matches the same message the late one would. With tensor parallelism each tensor
rank has its own peer on the next stage, and with partitioned boundaries (partitioned_wire.py) the
early receive fills the same slice buffer the late one would, reassembled when the stage takes it.
With several chunks per rank two chunks receive from the same peer, and an early receive could take
the other chunk's message (same shapes: silently wrong), so interleaved and zero-bubble schedules
keep torch's posting.

Only on gloo, whose sends and receives progress independently. NCCL runs the point-to-point ops
between two ranks on one stream in posting order unless they are posted as one batch, so a middle
stage's early receive of activation k + 1 could hold back its send of gradient j to the same
neighbour, which that neighbour needs before it computes and sends activation k + 1: a deadlock. Not
testable here (no accelerator), so NCCL keeps torch's posting.

No receive is left posted after a step: the last micro-batch posts none (a step that raised midway
can leave one, and the next step refuses to start: `start_step`).
"""
from __future__ import annotations

import torch.distributed as dist


class EarlyReceives:
    """The receives one stage has posted ahead, {(direction, micro-batch): works}."""

    def __init__(self, stage):
        self.stage = stage
        self.works: dict[tuple[str, int], list] = {}
        self.count = 0  # receives posted early so far (tests count them)

    def start_step(self) -> None:
        """A step that raised inside the schedule can leave a receive posted; the next step's first message
        would land in that micro-batch's buffer, so it is refused rather than misread."""
        if self.works:
            raise RuntimeError(f"pipeline stage {self.stage.stage_index}: an earlier train_batch/eval_batch stopped "
                               f"inside the schedule with receives still posted ({sorted(self.works)}); the stages "
                               "are out of step: rebuild the engine (engine.initialize) before the next batch")

    def posted(self, direction: str, mb: int) -> bool:
        return (direction, mb) in self.works

    def arrived(self, direction: str, mb: int) -> None:
        """Before micro-batch `mb` computes: wait for its early receive (if it had one), then post the
        next micro-batch's (module note)."""
        for work in self.works.pop((direction, mb), ()):
            work.wait()
        nxt, st = mb + 1, self.stage
        forward = direction == "forward"
        if nxt < len(st.args_recv_info if forward else st.grad_recv_info):  # one entry per micro-batch
            ops = st.get_fwd_recv_ops(nxt) if forward else st.get_bwd_recv_ops(nxt)
            if ops:
                self.works[(direction, nxt)] = dist.batch_isend_irecv(ops)
                self.count += 1
