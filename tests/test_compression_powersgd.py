"""PowerSGD gradient compression (ops.PowerSGD) and `gradient_compression` at ZeRO stage 0."""
from __future__ import annotations

import torch

import engine
from ops import PowerSGD
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches


class _OneRank:
    world_size, rank = 1, 0

    def all_reduce(self, tensor):
        return None


def test_low_rank_gradients_pass_exactly():
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(20, 2, generator=g) @ torch.randn(2, 30, generator=g)  # rank 2 <= rank 4
    vector = torch.randn(30, generator=g)
    flat = torch.cat([matrix.reshape(-1), vector])
    reducer = PowerSGD(_OneRank(), rank=4, start_step=0)
    out = flat.clone()
    reducer.reduce_(0, out, [matrix.shape, vector.shape])
    torch.testing.assert_close(out, flat, atol=1e-4, rtol=1e-4)


def test_error_feedback_recovers_a_full_rank_gradient_over_steps():
    matrix = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    reducer = PowerSGD(_OneRank(), rank=1, start_step=0)
    total, calls = torch.zeros(256), 60
    for _ in range(calls):
        out = matrix.reshape(-1).clone()
        reducer.reduce_("layer", out, [matrix.shape])
        total += out
    # Σ outputs = calls·M − e_calls: the error carried over is all that is missing.
    torch.testing.assert_close(total, calls * matrix.reshape(-1) - reducer._errors["layer"], atol=1e-3, rtol=1e-4)
    # The error stays bounded (rank 1 of 16 directions: several times ‖M‖), so the mean converges as 1/steps.
    assert reducer._errors["layer"].norm() < 10 * matrix.norm()
    assert (total / calls - matrix.reshape(-1)).norm() < 0.2 * matrix.norm()


def test_a_loaded_state_continues_bit_for_bit():
    """state_dict -> load_state_dict -> the next steps equal the reducer's own, bit for bit. BLAS rounds
    M·Q by where Q lies: a step leaves the Qs of a bucket as views of one buffer, and loaded each into a
    buffer of its own they gave other bits (a file resume 1.5e-8 off the uninterrupted run; 12 of these
    20 seeds differed)."""
    shapes = [torch.Size(s) for s in [(37, 13), (37,), (37, 37), (37,), (5, 37), (5,), (1,)]]  # OddMLP's
    numel = sum(s.numel() for s in shapes)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        grads = [torch.randn(numel, generator=g) for _ in range(6)]
        reducer = PowerSGD(_OneRank(), rank=1, start_step=0)
        for grad in grads[:3]:
            reducer.reduce_(0, grad.clone(), shapes)
        loaded = PowerSGD(_OneRank(), rank=1, start_step=0)
        loaded.load_state_dict(reducer.state_dict())
        for grad in grads[3:]:
            want, got = grad.clone(), grad.clone()
            reducer.reduce_(0, want, shapes)
            loaded.reduce_(0, got, shapes)
            assert torch.equal(got, want), f"seed {seed}: max |diff| {(got - want).abs().max():.3e}"


def _train_powersgd(start_step: int, steps: int):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 600},
           "gradient_compression": {"type": "powersgd", "rank": 2, "start_step": start_step}}
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=cfg)
    batches = make_batches(5, 4 * world, seed=3)
    volumes, losses = [], []
    for step in range(steps):
        x, y = batches[step % len(batches)]  # a few batches, repeated: the loss must fall
        eng.comm.stats.reset()
        loss = eng(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        eng.backward(loss)
        eng.step()
        volumes.append(eng.comm.stats.volume())
        losses.append(float(loss.detach()))
    grad_bytes = sum(p.numel() * 4 for p in eng.module.parameters() if p.requires_grad)
    return {"volumes": volumes, "losses": losses, "fp32_volume": 2.0 * grad_bytes,
            "params": [p.detach().clone() for p in eng.module.parameters()],
            "saved": "powersgd" in eng.training_state_dict()["zero_optimizer"]}


def test_powersgd_through_the_engine_on_two_ranks():
    a, b = run_distributed(_train_powersgd, 2, args=(3, 30), timeout=120)
    full = a["fp32_volume"]
    assert a["volumes"][:3] == [full] * 3  # exact all-reduce before start_step
    assert all(v < full / 2 for v in a["volumes"][3:]), (full, a["volumes"][3:6])
    for p, q in zip(a["params"], b["params"]):  # the low-rank mean is the same on every rank
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    assert sum(a["losses"][-5:]) < 0.8 * sum(a["losses"][:5]), a["losses"]
    assert a["saved"]


def _powersgd_resume(root: str):
    """Uninterrupted against saved at step 4 and resumed from the file (the reducer's errors, Q and step
    count come from each rank's own file: engine/checkpoint/rank_state.py)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 600},
           "gradient_compression": {"type": "powersgd", "rank": 1, "start_step": 2}}
    batches = make_batches(7, 4 * world, seed=5)

    def run(eng, todo):
        for x, y in todo:
            eng.backward(eng(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
            eng.step()
        return [p.detach().clone() for p in eng.module.parameters()]

    torch.manual_seed(0)
    straight = run(engine.initialize(model=OddMLP(), config=cfg)[0], batches)
    torch.manual_seed(0)
    eng = engine.initialize(model=OddMLP(), config=cfg)[0]
    run(eng, batches[:4])
    eng.save_checkpoint(root, tag="t")
    torch.manual_seed(1)  # another initial model: everything must come from the checkpoint
    resumed = engine.initialize(model=OddMLP(), config=cfg)[0]
    resumed.load_checkpoint(root, tag="t")
    return straight, run(resumed, batches[4:])


def test_powersgd_resumes_from_a_file_checkpoint_exactly(tmp_path):
    for straight, resumed in run_distributed(_powersgd_resume, 2, args=(str(tmp_path),), timeout=120):
        for a, b in zip(straight, resumed):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
