"""ZeRO stages 1 and 2 hold and move what the ZeRO paper says (arXiv:1910.02054 §5, §7).

Measured from the actual tensors and from `comm.stats`, on 2 ranks, Ψ = trainable elements:
- master weights + Adam state per rank = 12Ψ/N bytes, plus padding (< one row per parameter);
- stage 2 after the boundary backward: no full gradients, only the fp32 partition (4Ψ/N + padding);
- per step, stages 1 and 2 move stage 0's 2Ψ (reduce-scatter Ψ + all-gather Ψ, plus one 4-byte norm
  all-reduce); stage 1 is silent on accumulation micro-steps; stage 2 reduce-scatters Ψ on each one
  (stage2.py's note on accumulation).
"""
from __future__ import annotations

import torch

import engine
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

MICRO = 2
GAS = 3


def _run(stage: int):
    torch.manual_seed(0)
    model = OddMLP()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900,
                                 "overlap_comm": True}}
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    zopt, world = eng.zero_optimizer, eng.comm.world_size
    trainable = [p for p in model.parameters() if p.requires_grad]
    psi = sum(p.numel() for p in trainable)
    padding_bound = sum(p.numel() // p.shape[0] for p in trainable)  # < one row per parameter
    counts, grad_bytes_after_boundary = [], None
    x, y = make_batches(1, MICRO * GAS * world)[0]
    for k, (xm, ym) in enumerate(micro_batches(x, y, eng.comm.rank, world, GAS)):
        eng.comm.stats.reset()
        eng.backward(eng(xm, ym))
        if k == GAS - 1 and stage == 2:
            grad_bytes_after_boundary = zopt.gradient_bytes()
        eng.step()
        counts.append((eng.comm.stats.snapshot(), eng.comm.stats.volume()))
    state_bytes = zopt.partition.num_bytes()["master"] + sum(
        t.numel() * t.element_size() for s in zopt.optimizer.state.values() for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1) if stage else None
    return {"psi": psi, "world": world, "padding_bound": padding_bound, "counts": counts,
            "state_bytes": state_bytes, "grad_bytes": grad_bytes_after_boundary}


def _all_stages():
    return [_run(stage) for stage in (0, 1, 2)]


def test_zero_memory_and_communication_accounting():
    stage0, stage1, stage2 = run_distributed(_all_stages, 2, timeout=90)[0]
    psi, world, pad = stage1["psi"], stage1["world"], stage1["padding_bound"]
    # Memory: 12Ψ/N bytes of fp32 master + exp_avg + exp_avg_sq, padding at most one row per parameter.
    for r in (stage1, stage2):
        assert 12 * psi / world <= r["state_bytes"] <= 12 * (psi / world + pad)
    assert 4 * psi / world <= stage2["grad_bytes"] <= 4 * (psi / world + pad)
    # Communication: the boundary step moves stage 0's 2Ψ (fp32: 8Ψ bytes) up to padding and the norm.
    v0 = stage0["counts"][-1][1]
    assert v0 == 2 * 4 * psi
    for r in (stage1, stage2):
        boundary, volume = r["counts"][-1]
        assert set(boundary["bytes"]) == {"reduce_scatter", "all_gather", "all_reduce"}
        assert boundary["bytes"]["all_reduce"] == 4 and boundary["calls"]["all_reduce"] == 1  # the norm
        assert v0 <= volume - 2 * 4 <= v0 + 2 * 4 * world * pad
    # Accumulation micro-steps: stage 1 silent, stage 2 one Ψ reduce-scatter each.
    for snapshot, _ in stage1["counts"][:-1]:
        assert snapshot["bytes"] == {}
    for snapshot, volume in stage2["counts"][:-1]:
        assert set(snapshot["bytes"]) == {"reduce_scatter"} and 4 * psi <= volume <= 4 * (psi + world * pad)
