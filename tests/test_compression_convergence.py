"""1-bit Adam, 0/1 Adam and 1-bit LAMB train the demo GPT like Adam / LAMB (2 ranks, same data).

Claim (issue 8): after a few hundred steps the compressed optimizers' final loss is within 3% of the
uncompressed one's. Warm-up is 20% of the steps, as DeepSpeed's tutorials suggest (15-25%); 0/1 Adam
takes local steps (up to 4 between 1-bit synchronisations) for the last third. "Final loss" is the
mean training loss of the last 40 steps over both ranks, which share one data order. 200 steps (300
before: a third of the test's time): final ratios 1.014 / 1.008 / 1.021 of the baselines (300 steps: 1.024 /
1.012 / 0.990); with the error feedback dropped (ops/onebit.py's compress_ keeping no error) 1.23 / 1.08 /
1.26, every one caught.
"""
from __future__ import annotations

import pytest
import torch

import engine
from examples.gpt import GPT, ByteCorpus, GPTConfig

from tests.harness import run_distributed

TINY_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
STEPS, MICRO, TAIL = 200, 8, 40
WARMUP = STEPS // 4
ADAM = {"lr": 3e-3, "weight_decay": 0.0}
LAMB = {"lr": 1e-2, "weight_decay": 0.0}
RUNS = {
    "Adam": ("AdamW", ADAM),
    "OneBitAdam": ("OneBitAdam", {**ADAM, "freeze_step": WARMUP}),
    "ZeroOneAdam": ("ZeroOneAdam", {**ADAM, "var_freeze_step": 2 * STEPS // 3, "local_step_scaler": 25,
                                    "local_step_clipper": 4}),
    "Lamb": ("Lamb", LAMB),
    "OneBitLamb": ("OneBitLamb", {**LAMB, "freeze_step": WARMUP}),
}


def _final_loss(kind: str, params: dict, data: ByteCorpus) -> float:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
           "optimizer": {"type": kind, "params": params}, "zero_optimization": {"stage": 0}}
    eng, _, _, _ = engine.initialize(model=GPT(TINY_GPT), config=cfg)
    tail = torch.zeros(())
    for step in range(STEPS):
        start = ((step * world + rank) * MICRO) % (len(data) - MICRO)
        x, y = data.x[start:start + MICRO], data.y[start:start + MICRO]
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        if step >= STEPS - TAIL:
            tail += loss.detach()
    torch.distributed.all_reduce(tail)
    return float(tail) / (TAIL * world)


def _all_runs():
    data = ByteCorpus(seq_len=TINY_GPT.seq_len, max_bytes=400_000)
    return {name: _final_loss(kind, params, data) for name, (kind, params) in RUNS.items()}


@pytest.mark.slow
def test_compressed_optimizers_reach_the_uncompressed_loss():
    final = run_distributed(_all_runs, 2, timeout=600)[0]
    print("final losses:", {k: round(v, 4) for k, v in final.items()})
    assert final["Adam"] < 0.75 * 5.545  # it learned something: log(256) = 5.545 is uniform guessing
    for name, baseline in [("OneBitAdam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb")]:
        assert final[name] <= 1.03 * final[baseline], (name, final)
