"""`pipeline.schedule: "zb_h1"`: 1F1B with each backward split in two, weight gradients deferred.

[Note: why split] A stage's backward computes two things: the gradient of its input, which the stage
before waits for, and the gradients of its weights, which nobody waits for until the optimizer step.
1F1B computes both before sending, so every boundary of the drain carries the whole backward of the
stage after it. Here (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023, on torch's
split backward: `backward_one_chunk(full_backward=False)` then `backward_weight_one_chunk`) a stage
computes the input gradient (I), sends it, and computes the weight gradients (W) while the stages
before it work. The first stage's input needs no gradient, so it runs one full backward (B).
With unit costs F = I = W = 1 (B = 2) the step is 3m + p − 1 slots for m ≥ p — bubble (p−1)/(3m+p−1),
a third of 1F1B's — and 2m + 2p − 1 for m < p; at m = 1 on 2 stages, 5 slots against 1F1B's 6.

[Note: the order] Stage s runs 1F1B's order (p − s forwards first, torch's count, then one backward
per forward), the backward being I, and defers W of micro-batch j until I of j + s has run (all that
are left at the end): the later a stage, the longer its W can wait before the stage before it needs
anything, so on every stage the W's fill time that was waiting in 1F1B. A stage holds at most p
micro-batches of activations (torch keeps a micro-batch's graph until its W): the first stage's
1F1B peak, now on every stage. The orders were chosen on a small event simulation of the two stage
counts measured (2 and 4) and m = 1-8; this deferral was the best or within 0.3% of it everywhere.

[Note: the messages] The posts and waits are torch's Schedule1F1B's, in its order and with its
pairs fused (the send of a forward's activation with the receive of a backward's gradient, and the
reverse), so each peer sees 1F1B's messages in 1F1B's order on any backend; a W runs between posting a
pair and waiting for it, so a gradient leaves before the weight work that follows its I. NCCL also needs
each message posted alike on both sides, in a batch on both or alone on both (a lazily initialised
ProcessGroupNCCL runs batched operations on the group's communicator and a lone send or receive on a
two-rank one of its own, which never meet): at m < p − s, which torch's class refuses, the next stage
receives all m activations in its warm-up, alone, so stage s sends its last one alone too
(tests/test_pipeline_zb_h1_compose.py checks every message's two sides for 2-4 stages and m = 1-6).
Not run on NCCL here.
"""
from __future__ import annotations

from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

from .stage_loop import StageLoop


def zb_h1_bubble(p: int, m: int) -> float:
    """The unit-cost bubble of this schedule (module note): idle slots over the step's slots."""
    late = max(0, p - m)  # with fewer micro-batches than stages the drain's I's cannot overlap
    return (p - 1 + late) / (3 * m + p - 1 + late)


class ZeroBubbleH1(StageLoop):
    """One stage per rank; torch's stage computes and messages, this orders them (module notes)."""

    def _loop(self) -> None:
        stage, m = self._stage, self._n_microbatches
        if not self._has_backward:  # eval_batch: forwards only, each send waited before the next receive
            for k in range(m):
                _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(k)))
                _wait_batch_p2p(_batch_p2p(self._forward(k)))
            return
        split = not stage.is_first  # the first stage's input needs no gradient: whole backwards there
        pending: list[int] = []  # micro-batches whose I ran and W did not

        def weights(upto: int) -> None:
            while pending and pending[0] <= upto:
                j = pending.pop(0)
                stage.backward_weight_one_chunk(j, last_backward=j == m - 1)

        def backward(k: int) -> list:
            if split:
                pending.append(k)
            return self._backward(k, full=not split)

        lead = min(m, self._num_stages - stage.stage_index)
        # the last warm-up activation goes out with the first gradient's receive where the next stage takes
        # it in its steady state, batched with a gradient's send; where m is so small that the next stage
        # takes every activation in its warm-up, one by one, it goes alone (the module's third note)
        fused = m >= self._num_stages - stage.stage_index
        defer = stage.stage_index
        sends, posted = [], []
        for k in range(lead):
            _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(k)))
            ops = self._forward(k)
            _wait_batch_p2p(posted)
            sends, posted = (ops, []) if fused and k == lead - 1 else ([], _batch_p2p(ops))
        _wait_batch_p2p(posted)
        f = lead
        for b in range(m):
            _wait_batch_p2p(_batch_p2p(sends + stage.get_bwd_recv_ops(b)))
            sends = backward(b)
            if f < m:  # this gradient leaves with the next activation's receive; W's run meanwhile
                work = _batch_p2p(sends + stage.get_fwd_recv_ops(f))
                weights(b - defer)
                _wait_batch_p2p(work)
                sends = self._forward(f)
                f += 1
            else:  # the drain
                work = _batch_p2p(sends)
                weights(b - defer if b < m - 1 else m)
                _wait_batch_p2p(work)
                sends = []
