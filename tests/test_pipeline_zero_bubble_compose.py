"""pipeline.schedule "zero_bubble" (torch's ScheduleInterleavedZeroBubble, 2 chunks per rank) with bf16
weights accumulating their gradients in fp32 (`data_types.grad_accum_dtype`), at ZeRO-0 and ZeRO-1 with
`ignore_unused_parameters: false`, trains as "interleaved_1f1b" on 2 ranks, bit for bit, and reports the
same gradient norms.

The split backward's weight half (torch's `stage_backward_weight`) assigns `.grad` itself, so the
engine's post-accumulate-grad hooks (fp32 accumulation, ZeRO's partitions, the arrival log of the
unused-parameter check) run after it in engine/pipe/schedule.py ([Note: the weight half's hooks]).
tests/test_pipeline_zb_h1_compose.py covers that for "zb_h1"; here the same override runs under torch's
interleaved schedule, whose layout puts chunks 0 and 2 on rank 0 and chunks 1 and 3 on rank 1. torch
runs chunk 0's whole backward in its weight action (through AccumulateGrad, so the override skips it);
chunk 2 (rank 0) and chunks 1 and 3 (rank 1, 3 holding the LM head tied to chunk 0's embedding) are
split, and the test checks that they were.

Bit for bit: both schedules run each chunk's backwards in micro-batch order 0..m-1 and each gradient of
a micro-batch is the same bf16 product (autograd.grad of the weights from the same saved tensors as the
full backward), so the fp32 buffers receive the same addends in the same order. Without the override's
hooks the check at ZeRO-0 already says rank 0's 5.weight, 5.bias (chunk 2) and rank 1's 3.weight, 3.bias
and the tied embedding (chunks 1, 3) got no gradient; with the check off, rank 1 aborts in the tied
weights' all-reduce (its copy's gradient never reached the fp32 buffer).
"""
from __future__ import annotations

import torch

from tests.harness import run_distributed

STEPS, GAS = 3, 4  # zero_bubble needs the micro-batches to be a multiple of its rounds (m // p = 2)


def _runs() -> dict:
    """Per (schedule, ZeRO stage): this rank's fp32 master weights after STEPS steps, their update, the
    reported gradient norms, and the chunks whose weight gradient ran as its own action ("W" after "I")."""
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    from tests.pipe_models import global_batches, lm_loss, tied_specs
    from tests.test_pipeline import MICRO, _config
    out = {}
    for zero in (0, 1):
        for schedule in ("interleaved_1f1b", "zero_bubble"):
            pm = PipelineModule(tied_specs(6), num_stages=2, loss_fn=lm_loss, seed_layers=True,
                                partition_method="uniform", virtual_stages=2)
            eng, *_ = engine.initialize(model=pm, config=_config(schedule, GAS, 0, {
                "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                "zero_optimization": {"stage": zero, "ignore_unused_parameters": False}}))
            start = {n: safe_get_full_fp32_param(p).clone() for n, p in pm.named_parameters()}
            norms = []
            for x, y in global_batches(STEPS, MICRO * GAS, True):
                eng.train_batch(iter(list(micro_batches(x, y, 0, 1, GAS))))
                norms.append(eng.get_global_grad_norm())
            params = {n: safe_get_full_fp32_param(p).clone() for n, p in pm.named_parameters()}
            actions = eng.schedule_actions()[eng.stage_id]
            out[schedule, zero] = {"params": params, "update": {n: params[n] - start[n] for n in params},
                                   "norms": norms, "split": sorted({s for kind, s, _ in actions if kind == "W"})}
            eng.destroy()
    return out


def test_zero_bubble_accumulates_bf16_gradients_in_fp32_as_interleaved_1f1b():
    results = run_distributed(_runs, world_size=2, timeout=120)
    # torch's interleaved layout: chunk c on rank c % 2; chunk 0's "W" is its whole backward
    assert [r["zero_bubble", 0]["split"] for r in results] == [[0, 2], [1, 3]]
    assert results[0]["zero_bubble", 0]["params"].keys() & results[1]["zero_bubble", 0]["params"].keys() \
        == {"tied_modules.embed.weight"}  # the tie crosses the ranks: split chunk 3 holds the LM head
    for rank, r in enumerate(results):
        assert r["interleaved_1f1b", 0]["split"] == []  # the reference runs only full backwards
        for zero in (0, 1):
            want, got = r["interleaved_1f1b", zero], r["zero_bubble", zero]
            assert want["params"].keys() == got["params"].keys()
            for name, update in want["update"].items():
                assert update.abs().max() > 0, (rank, zero, name)  # every parameter moved: the oracle can fail
                assert torch.equal(got["params"][name], want["params"][name]), \
                    (rank, zero, name, (got["params"][name] - want["params"][name]).abs().max().item())
            assert got["norms"] == want["norms"], (rank, zero, got["norms"], want["norms"])
