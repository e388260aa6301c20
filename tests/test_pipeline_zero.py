"""Pipeline × data parallelism on 4 ranks (2 stages × 2 data-parallel ranks): ZeRO-1 and ZeRO-2 over
the data axis equal single-process SGD; with clipping every rank reports, and clips with, the norm of
the whole model's gradient (the tied embedding counted once); an Inf produced on one stage makes every
rank skip that step; ZeRO-3 with a pipeline is refused naming the key."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import Reference, global_batches, lm_loss, reference_params, reference_sgd, tied_specs
from tests.test_pipeline import LR, MICRO, STEPS, _check_against_reference, _config, _train

GAS, INF_STEP, CLIP = 2, 2, 0.05


def _train_with(zero: int, clip: float = 0.0, inf_at: int | None = None, extra: dict | None = None):
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config("1f1b", GAS, zero, {"gradient_clipping": clip, **(extra or {})}))
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    poison = []
    if inf_at is not None and eng.stage_id == 1:  # only the second stage's hidden layer sees it
        layer = next(m for n, m in pm.named_children() if n.isdigit() and isinstance(m, torch.nn.Linear))
        layer.weight.register_hook(lambda g: g * float("inf") if poison else g)
    start = {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()} if extra else None
    losses, norms = [], []
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * GAS * dp, True)):
        poison[:] = [True] if step == inf_at else []
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))))
        norms.append(eng.get_global_grad_norm())
    if extra:  # low precision: the fp32 master weights' total update (they start from the rounded weights)
        return ({n: safe_get_full_fp32_param(p) - start[n] for n, p in pm.named_parameters()}, losses, norms,
                eng.skipped_steps)
    return ({n: p.detach().clone() for n, p in pm.named_parameters()}, losses, norms, eng.skipped_steps)


def _all_cases():
    return {"zero1": _train_with(1), "zero2": _train_with(2), "clip": _train_with(2, clip=CLIP),
            "inf": _train_with(0, inf_at=INF_STEP), "zero3": _zero3(),
            "bf16": _train_with(1, extra={"bf16": {"enabled": True}})}


def test_two_stages_by_two_data_ranks():
    per_rank = run_distributed(_all_cases, world_size=4, timeout=300)
    for zero in ("zero1", "zero2"):
        _check_against_reference([r[zero][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
    # clipping: the world's norm, identical on all 4 ranks, and the reference's clipped trajectory
    ref_norms: list = []
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           clip=CLIP, norms=ref_norms)
    assert ref_norms[-1] > CLIP  # clipping really acted
    want = reference_params(ref)
    for r in per_rank:
        params, _, norms, _ = r["clip"]
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"clipped {name}")
    # an Inf on stage 1 only: every rank skips that step, and only that one
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           skip={INF_STEP})
    want = reference_params(ref)
    for r in per_rank:
        params, _, norms, skipped = r["inf"]
        assert skipped == 1
        assert not torch.isfinite(torch.tensor(norms[INF_STEP]))
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"after the skip, {name}")
    # bf16 weights, fp32 master weights at ZeRO-1: each parameter's total update (master − its start) within
    # 5% of the fp32 reference's. bf16 rounds activations and gradients to ~0.4%, so a few percent is
    # what 5 steps drift; a gradient off by 2x (a missing 1/m, a tied gradient counted twice) is 100%.
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS)
    want, init = reference_params(ref), reference_params(Reference(tied_specs(4)))
    for r in per_rank:
        params, _, _, skipped = r["bf16"]
        assert skipped == 0
        for name, p in params.items():
            torch.testing.assert_close(p, want[name] - init[name], rtol=5e-2, atol=2e-4,
                                       msg=f"bf16 update of {name}")
    # ZeRO-3 with a pipeline: refused on every rank, naming the key
    for r in per_rank:
        assert r["zero3"] is not None and "zero_optimization.stage: 3 with a PipelineModule" in r["zero3"]


def _zero3():
    import engine
    import schemas
    from engine.pipe import PipelineModule
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss)
    try:
        engine.initialize(model=pm, config=_config("1f1b", GAS, 3))
    except schemas.ConfigError as err:
        return str(err)
    return None


