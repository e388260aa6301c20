"""Tied weights across pipeline stages with `data_types.grad_accum_dtype` wider than the model's (fp32
accumulation of bf16/fp16 gradients), at ZeRO stages 0-3.

A wider accumulation dtype keeps the accumulated gradient out of `.grad` (a side tensor of that dtype),
and the tie group's sum once read `.grad` only: it summed zeros, so each stage stepped the tied weight
with its own half of the gradient and the copies drifted apart (6e-2 after 4 steps, 10% from the
fp32 reference). Oracle: 2 stages, embedding tied to the LM head, gradient accumulation 2, SGD without
clipping (linear in the gradient) for 4 steps; the tied weight equal on both stages bit for bit, every
weight within 1% of single-process fp32 torch (bf16 rounding alone is ~0.3%) and the reported norms
within 1% of torch's.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import micro_batches
from tests.pipe_models import global_batches, lm_loss, reference_params, reference_sgd, tied_specs

STEPS, GAS, MICRO, LR = 4, 2, 2, 0.5
CASES = [(0, "bf16"), (1, "bf16"), (2, "fp16"), (3, "bf16")]


def _tied_runs() -> dict:
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    out = {}
    for zero, precision in CASES:
        module = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
               "gradient_clipping": 0.0, "zero_optimization": {"stage": zero},
               "data_types": {"grad_accum_dtype": "fp32"},
               precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}}
        eng = engine.initialize(model=module, config=cfg)[0]
        norms = []
        for x, y in global_batches(STEPS, MICRO * GAS, True):
            eng.train_batch(iter(list(micro_batches(x, y, 0, 1, GAS))))
            norms.append(eng.get_global_grad_norm())
        out[(zero, precision)] = {"norms": norms, "params": {n: safe_get_full_fp32_param(p).clone()
                                                             for n, p in module.named_parameters()}}
        eng.destroy()
    return out


@pytest.fixture(scope="module")
def runs():
    from tests.harness import run_distributed
    return run_distributed(_tied_runs, 2, timeout=300)


@pytest.fixture(scope="module")
def reference():
    norms = []
    model, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS, True), lm_loss, LR, STEPS, norms=norms)
    return reference_params(model), norms


@pytest.mark.parametrize("zero,precision", CASES, ids=lambda v: str(v))
def test_a_tied_weight_sums_its_wide_accumulated_gradient_over_the_stages(runs, reference, zero, precision):
    want, want_norms = reference
    tied = "tied_modules.embed.weight"
    first, last = runs[0][(zero, precision)], runs[1][(zero, precision)]
    assert torch.equal(first["params"][tied], last["params"][tied]), \
        f"the tied copies differ by {(first['params'][tied] - last['params'][tied]).abs().max().item():.3e}"
    for stage, run in enumerate((first, last)):
        for name, got in run["params"].items():
            err = ((got - want[name]).abs().max() / want[name].abs().max()).item()
            assert err < 1e-2, f"stage {stage} {name}: {err:.3e} of the fp32 reference"
        for got, ref in zip(run["norms"], want_norms):
            assert abs(got - ref) < 1e-2 * ref, (stage, run["norms"], want_norms)
