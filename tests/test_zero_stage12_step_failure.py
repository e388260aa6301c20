"""ZeRO stages 1 and 2 with the optimizer on NVMe: a step that fails on ONE rank only (a write of its
optimizer state raising OffloadIOError halfway through the step). Before, that rank raised out of the step
while the other ranks went on into the parameter all-gather after the step and waited there until the
process group's timeout (partitioned.py's note: a step failed on some rank). Now every rank raises from
the same `engine.step()`: rank 1 its own OffloadIOError (naming the swap file and the key), rank 0
`PeerStepError` naming rank 1; the step is applied on no rank (two slots: the ranks that committed it go
back to the state before it, bit for bit), the window's gradients are dropped, and training on equals a
run that never saw the batch. With `swap_slots: 1` (written in place) every rank refuses the next step
until a checkpoint load, after which training equals that run too.

Rank 1's writes of its momentum swap files past the first sub-group fail (an EIO injected at os.pwritev,
the aio workers' write: the stage-3 test's `_state_writes_fail`) in the step of batch FAILED only; SGD
with momentum, no clipping, fp32: the oracle is linear in the gradient and exact."""
from __future__ import annotations

import os

import torch

from tests.harness import run_distributed
from tests.test_zero_stage3_step_failure import (FAILED, STEPS, _state_writes_fail, check_ranks, model_and_groups,
                                                 rank_batches)


def _engine(path: str, stage: int, slots: int, groups: int):
    import engine
    model, params = model_and_groups(groups)
    zero = {"stage": stage, "sub_group_size": 512,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "swap_slots": slots}}
    return engine.initialize(model=model, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": zero, "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "aio": {"block_size": 4096}})[0]


def _train(eng, data, fail_at: int | None, errors: dict, batches, groups: int) -> None:
    for i in batches:
        try:
            x, y = data[i]
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            with _state_writes_fail(i == fail_at, groups, "momentum_buffer"):
                eng.step()
        except RuntimeError as err:
            errors.setdefault(i, []).append((type(err).__name__, str(err)))


def _run(tmp: str, stage: int, slots: int, groups: int) -> dict:
    """The failing run and a reference without batch FAILED, one after the other on the same ranks."""
    data = rank_batches(STEPS)
    out = {"errors": {}}
    for name in ("ref", "fail"):
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        eng = _engine(path, stage, slots, groups)
        assert eng.zero_optimizer.stage == stage and len(eng.zero_optimizer.nvme.parts) == groups
        if name == "ref":
            _train(eng, data, None, out["errors"], [i for i in range(STEPS) if i != FAILED], groups)
        else:
            eng.save_checkpoint(os.path.join(path, "ckpt"), tag="start")
            _train(eng, data, FAILED, out["errors"], range(STEPS), groups)
            if slots == 1:  # refused (batch FAILED + 1) until a load; then the reference's batches
                eng.load_checkpoint(os.path.join(path, "ckpt"), tag="start")
                _train(eng, data, None, out["errors"], [i for i in range(STEPS) if i != FAILED], groups)
        out[name] = [p.detach().clone() for p in eng.module.parameters()]
        eng.destroy()
    return out


def _check(tmp_path, stage: int, slots: int = 2, groups: int = 1) -> None:
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), stage, slots, groups), timeout=60)
    check_ranks(ranks, slots, "momentum_buffer")
    (kind, msg), = ranks[0]["errors"][FAILED]
    assert msg.startswith(f"ZeRO-{stage}: rank 1's"), msg


def test_stage1_one_rank_failing_its_step_fails_it_on_every_rank(tmp_path):
    _check(tmp_path, stage=1)


def test_stage2_one_rank_failing_its_step_fails_it_on_every_rank(tmp_path):
    _check(tmp_path, stage=2)


def test_stage2_the_failing_rank_undoes_the_flats_it_stepped_before_the_failure(tmp_path):
    # two param groups: rank 1 commits the first flat's step, then fails in the second's
    _check(tmp_path, stage=2, groups=2)


def test_stage1_in_place_slots_refuse_until_a_load(tmp_path):
    _check(tmp_path, stage=1, slots=1)
