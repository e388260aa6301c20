"""fp16 with dynamic loss scaling, the optimizer on NVMe: a step that fails on ONE rank only (its momentum
writes past the first sub-group raise EIO: the step-failure tests' injection) is undone on every rank, and
so is what the step's loss-scale check moved before it: the scaler (scale, iteration, hysteresis) and the
guard's consecutive-skip count. Before, the check had already counted the failed step as a clean one, so
with `loss_scale_window` 2 the scale grew one step early after the failure and training on was not a run
without the batch. The engine's counters (global_steps, skipped_steps, micro_steps) and the LR schedule do
not advance past a failed step (the engine raises before them); checked here too, with an fp16 overflow
after the failure, whose skip must stay as it was: the scale halves (hysteresis 1), the step is skipped.

Oracle: the same engine run on the batches without the failed one, SGD with momentum, no clipping;
scaler state, counters, LR and weights equal bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_stage3_step_failure import (FAILED, _state_writes_fail, _weights, check_ranks, model_and_groups,
                                                 rank_batches)

BATCHES, OVERFLOW = 7, 4  # growth every 2 clean steps: at batch 1, then 4 clean steps after the failure


def _engine(path: str, stage: int):
    import engine
    model, params = model_and_groups(1)
    return engine.initialize(model=model, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "sub_group_size": 512,
                              "offload_optimizer": {"device": "nvme", "nvme_path": path}},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.05}},
        "aio": {"block_size": 4096}})[0]


def _train(eng, data, fail_at: int | None, errors: dict) -> None:
    for i, (x, y) in enumerate(data):
        if i == FAILED and fail_at is None:
            continue  # the reference never sees the batch
        try:
            eng.backward(torch.nn.functional.mse_loss(eng(x.half()).float(), y))
            with _state_writes_fail(i == fail_at, 1, "momentum_buffer"):
                eng.step()
        except RuntimeError as err:
            errors.setdefault(i, []).append((type(err).__name__, str(err)))


def _run(tmp: str, stage: int) -> dict:
    data = rank_batches(BATCHES)
    data[OVERFLOW][0][0, 0] = float("inf")  # Inf/NaN gradients: an fp16 overflow, skipped
    out = {"errors": {}}
    for name in ("ref", "fail"):
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        eng = _engine(path, stage)
        _train(eng, data, FAILED if name == "fail" else None, out["errors"])
        guard = eng.zero_optimizer.guard
        out[f"{name}_state"] = (guard.state_dict(), eng.global_steps, eng.skipped_steps, eng.micro_steps,
                                eng.get_lr(), eng.lr_scheduler.state_dict(), eng.get_global_grad_norm())
        out[name] = _weights(eng)
        eng.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_scaler_and_counters_equal_a_run_without_the_failed_batch(tmp_path, stage):
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), stage), timeout=60)
    check_ranks(ranks, 2, "momentum_buffer")
    for rank, out in enumerate(ranks):
        assert out["fail_state"] == out["ref_state"], (rank, out["fail_state"], out["ref_state"])
        guard, steps = out["ref_state"][0], out["ref_state"][1:4]
        assert steps == (BATCHES - 1, 1, BATCHES - 1) and guard["total_skips"] == 1, steps  # the overflow, once
        assert guard["scaler"]["cur_scale"] == 2.0 ** 4 * 2 * 2 / 2, guard  # grew twice, halved at the overflow
