"""pipeline.schedule "zb_h1" on NCCL: every activation and gradient is posted the same way by its sender
and its receiver, batched (`batch_isend_irecv`) on both sides or alone on both, as torch's Schedule1F1B
posts them.

[Note: why both sides alike] ProcessGroupNCCL (lazily initialised, as engine/dist.py does: no device_id)
runs the point-to-point operations inside a `batch_isend_irecv` on the group's communicator and a lone
isend/irecv on a communicator of its own for the two ranks. A send posted in a batch and received by a
lone irecv are on two communicators and never meet: both ranks wait until the watchdog's timeout. gloo
matches them either way, so the multi-process tests (tests/test_pipeline.py) cannot see it; this test
records what the schedule's own loop posts, with a stage that only names its messages, for 2-4 stages
and 1-6 micro-batches, without processes.

And with bf16 weights accumulating their gradients in fp32 (`data_types.grad_accum_dtype`), at ZeRO-0
and at ZeRO-1 with `ignore_unused_parameters: false`, "zb_h1" trains as "1f1b" on 2 stages, bit for bit.
The fp32 accumulation, ZeRO's partitions and the unused-parameter check take gradients in
post-accumulate-grad hooks; torch's weight-gradient half (`stage_backward_weight`) assigns `.grad`
itself, so the stage runs them after it (engine/pipe/schedule.py, [Note: the weight half's hooks]).
Without that: ZeRO-0 lost the split stage's updates, ZeRO-1 aborted in the tied weights' all-reduce
(fp32 against bf16 bytes), and the check said 3 parameters got no gradient.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.pipelining.schedules as torch_schedules

import engine.pipe.zb_h1 as zb_h1
from tests.harness import run_distributed


class _NamingStage:
    """Stands in for torch's PipelineStage: its ops are (direction, kind, micro-batch, peer) names."""

    def __init__(self, index: int, num_stages: int):
        self.stage_index, self.is_first, self.is_last = index, index == 0, index == num_stages - 1

    def get_fwd_recv_ops(self, k):
        return [] if self.is_first else [("recv", "F", k, self.stage_index - 1)]

    def get_bwd_recv_ops(self, k):
        return [] if self.is_last else [("recv", "B", k, self.stage_index + 1)]

    def get_fwd_send_ops(self, k):
        return [] if self.is_last else [("send", "F", k, self.stage_index + 1)]

    def get_bwd_send_ops(self, k):
        return [] if self.is_first else [("send", "B", k, self.stage_index - 1)]

    def forward_one_chunk(self, *args, **kwargs):
        pass

    def backward_one_chunk(self, *args, **kwargs):
        pass

    def backward_weight_one_chunk(self, *args, **kwargs):
        pass

    def perform_reduce_grad(self, *args):
        pass


def _recording(monkeypatch, module, posts: list) -> None:
    """`module`'s _batch_p2p records each non-empty post (its ops, whether batched) instead of posting."""
    ids = itertools.count()

    def post(ops, desc=None):
        if not ops:
            return []
        posts.append((list(ops), len({op[0] for op in ops}) > 1))  # mixed: batch_isend_irecv
        return [next(ids)]
    monkeypatch.setattr(module, "_batch_p2p", post)
    monkeypatch.setattr(module, "_wait_batch_p2p", lambda works: None)


def _zb_h1_posts(monkeypatch, index: int, p: int, m: int) -> list:
    posts: list = []
    _recording(monkeypatch, zb_h1, posts)
    sched = zb_h1.ZeroBubbleH1.__new__(zb_h1.ZeroBubbleH1)
    stage = _NamingStage(index, p)
    sched._stage, sched._n_microbatches, sched._num_stages, sched._has_backward = stage, m, p, True
    sched._forward = stage.get_fwd_send_ops
    sched._backward = lambda k, full=True: stage.get_bwd_send_ops(k)
    sched._loop()
    return posts


def _one_f_one_b_posts(monkeypatch, index: int, p: int, m: int) -> list:
    posts: list = []
    _recording(monkeypatch, torch_schedules, posts)
    sched = torch_schedules.Schedule1F1B.__new__(torch_schedules.Schedule1F1B)
    sched._stage, sched._n_microbatches, sched._num_stages = _NamingStage(index, p), m, p
    sched._has_backward, sched.scale_grads = True, True
    sched._check_inputs = lambda *args: ([None] * m, [{}] * m)
    sched._initialize_stage = sched._maybe_compute_loss = sched._maybe_get_loss = sched._update_losses = \
        lambda *args: None
    sched._step_microbatches()
    return posts


def _mismatches(posts_of) -> list:
    """Messages whose sender posts them batched and receiver alone, or the reverse (module note)."""
    batched: dict = {}  # (sender, receiver, kind, micro-batch) -> {side: batched?}
    for rank, posts in posts_of.items():
        for ops, mixed in posts:
            for direction, kind, k, peer in ops:
                sender, receiver = (rank, peer) if direction == "send" else (peer, rank)
                batched.setdefault((sender, receiver, kind, k), {})[direction] = mixed
    assert all(len(sides) == 2 for sides in batched.values()), batched  # every message posted on both sides
    return sorted(key for key, sides in batched.items() if sides["send"] != sides["recv"])


def test_the_check_passes_torchs_1f1b(monkeypatch):
    for p, m in ((2, 2), (2, 5), (3, 3), (4, 6)):
        assert _mismatches({s: _one_f_one_b_posts(monkeypatch, s, p, m) for s in range(p)}) == [], (p, m)


CASES = [(p, m) for p in (2, 3, 4) for m in range(1, 7)]


@pytest.mark.parametrize("p, m", CASES)
def test_zb_h1_posts_each_message_alike_on_both_sides(monkeypatch, p, m):
    assert _mismatches({s: _zb_h1_posts(monkeypatch, s, p, m) for s in range(p)}) == [], (p, m)


def _fp32_accumulation_updates() -> dict:
    """Per (schedule, ZeRO stage), this stage's fp32 master weights' update after a step of 2 micro-batches
    (bf16 weights, fp32 gradient accumulation, SGD unclipped); ZeRO-1 also with `ignore_unused_parameters:
    false`, whose check reads the same hooks (engine/pipe/schedule.py's note on the weight half's hooks)."""
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    from tests.pipe_models import global_batches, lm_loss, tied_specs
    from tests.test_pipeline import MICRO, _config
    out = {}
    for schedule, zero in (("1f1b", 0), ("zb_h1", 0), ("1f1b", 1), ("zb_h1", 1)):
        pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
        eng, *_ = engine.initialize(model=pm, config=_config(schedule, 2, 0, {
            "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage": zero, "ignore_unused_parameters": zero == 0}}))
        start = {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()}
        for x, y in global_batches(1, MICRO * 2, True):
            eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2))))
        out[schedule, zero] = {n: safe_get_full_fp32_param(p) - start[n] for n, p in pm.named_parameters()}
        eng.destroy()
    return out


def test_zb_h1_accumulates_bf16_gradients_in_fp32_as_1f1b():
    for rank, r in enumerate(run_distributed(_fp32_accumulation_updates, world_size=2, timeout=120)):
        for zero in (0, 1):
            for name, update in r["1f1b", zero].items():
                assert update.abs().max() > 0, (rank, zero, name)
                assert torch.equal(r["zb_h1", zero][name], update), (rank, zero, name)
