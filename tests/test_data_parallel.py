"""ZeRO stage 0 (data parallelism) is exactly single-process training on the global batch."""
from __future__ import annotations

import pytest
import torch

import engine
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches, reference_train

STEPS = 5
MICRO = 2


def _config(gas: int, world: int, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        # Small buckets so a step needs several collectives and their order matters.
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 600, "overlap_comm": True},
    }
    cfg.update(extra)
    return cfg


def _train_dp(gas: int, overlap: bool):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = OddMLP()
    cfg = _config(gas, world)
    cfg["zero_optimization"]["overlap_comm"] = overlap
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    for x, y in make_batches(STEPS, MICRO * gas * world):
        for xm, ym in micro_batches(x, y, rank, world, gas):
            eng.backward(eng(xm, ym))
            eng.step()
    return {k: v.clone() for k, v in eng.module.state_dict().items()}, eng.global_steps, eng.micro_steps


def _reference(world: int, gas: int):
    torch.manual_seed(0)
    model = OddMLP()
    batches = make_batches(STEPS, MICRO * gas * world)
    ref, _, _ = reference_train(model, batches, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1,
                                                                            fused=True), clip=0.5)
    return ref.state_dict()


def _assert_same(a: dict, b: dict, atol: float = 1e-6) -> None:
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def _cases(world: int):
    return [(gas, overlap) for gas in (1, 4) for overlap in (True, False)]


def _train_all(world: int):
    return [_train_dp(gas, overlap) for gas, overlap in _cases(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_single_process(world):
    results = run_distributed(_train_all, world, args=(world,), timeout=120)
    for i, (gas, overlap) in enumerate(_cases(world)):
        ref = _reference(world, gas)
        for rank in range(world):
            state, global_steps, micro_steps = results[rank][i]
            assert global_steps == STEPS and micro_steps == STEPS * gas
            _assert_same(state, ref)


def _bytes_per_step():
    torch.manual_seed(0)
    model = OddMLP()
    eng, _, _, _ = engine.initialize(model=model, config=_config(gas=3, world=2))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    counts = []
    x, y = make_batches(1, MICRO * 3 * 2)[0]
    for xm, ym in micro_batches(x, y, eng.comm.rank, 2, 3):
        eng.comm.stats.reset()
        eng.backward(eng(xm, ym))
        eng.step()
        counts.append(eng.comm.stats.snapshot())
    n_buckets = len(eng.zero_optimizer.buckets.buckets)
    return grad_bytes, n_buckets, counts


def test_stage0_all_reduces_gradient_bytes_once_per_step():
    grad_bytes, n_buckets, counts = run_distributed(_bytes_per_step, 2)[0]
    assert n_buckets > 1
    assert counts[0]["bytes"] == {} and counts[1]["bytes"] == {}  # accumulation micro-steps: silent
    assert counts[2]["bytes"] == {"all_reduce": grad_bytes}
    assert counts[2]["calls"] == {"all_reduce": n_buckets}


def _initial_broadcast():
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)  # every rank builds different weights
    model = OddMLP()
    eng, _, _, _ = engine.initialize(model=model, config=_config(gas=1, world=2))
    return eng.module.state_dict()


def test_parameters_broadcast_from_rank0():
    a, b = run_distributed(_initial_broadcast, 2)
    torch.manual_seed(0)
    expected = OddMLP().state_dict()
    _assert_same(a, expected, atol=0)
    _assert_same(b, expected, atol=0)
