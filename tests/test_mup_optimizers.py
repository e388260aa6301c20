"""mup's μP optimizers from the config (`"type": "muadam"`, `"muadamw"`, `"musgd"`; engine/mup_optimizers.py)
equal `mup.MuAdam`, `mup.MuAdamW`, `mup.MuSGD` in one process on the global batch, at ZeRO stages 0-3
on 2 ranks, with accumulation and with the optimizer offloaded to the CPU and to NVMe at stages 1-3,
where each also equals the same run without offload bit for bit.

The model's widths differ from its base shapes (`mup.set_base_shapes`), so its matrix-like parameters
get their own learning rates (lr / width_mult for Adam, lr / fan-in:fan-out ratio for SGD): a stage
that stepped a flat with one lr, or dropped mup's param groups, would not match. Reference: mup's own
classes (torch's Adam/AdamW/SGD underneath). Tolerance: fp32, atol 2e-5 after 5 steps (summation order
of the ranks' reductions only, as tests/test_optimizer_set.py).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import engine
import schemas
from engine.utils import safe_get_full_fp32_param
from tests import optimizer_runs
from tests.models import make_batches, micro_batches

import mup  # noqa: E402  (.ci/setup installs it: a missing mup fails here, it is not skipped)

STEPS, MICRO = 5, 2
PARAMS = {"MuAdam": {"lr": 0.02, "weight_decay": 0.01}, "MuAdamW": {"lr": 0.02, "weight_decay": 0.1},
          "MuSGD": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
# (type, stage, gas, offload); MuSGD is torch's SGD, untested at ZeRO >= 1 in DeepSpeed's sense.
# MuAdamW runs without accumulation, the others with: both ways at every stage and tier.
GAS = {"MuAdam": 2, "MuAdamW": 1, "MuSGD": 2}
IN_MEMORY = [("MuAdam", 0, 2, "none")] + [(k, s, GAS[k], "none") for k in GAS for s in (1, 2, 3)]
OFFLOADED = [(k, s, GAS[k], offload) for offload in ("cpu", "nvme") for k in GAS for s in (1, 2, 3)]
CASES = IN_MEMORY + OFFLOADED


class MupNet(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp, self.hid = nn.Linear(13, width), nn.Linear(width, width)
        self.out = mup.MuReadout(width, 5)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.out(torch.tanh(self.hid(torch.tanh(self.inp(x))))), y)


def make_model() -> MupNet:
    base, delta = MupNet(4), MupNet(6)
    torch.manual_seed(0)
    model = MupNet(12)
    mup.set_base_shapes(model, base, delta=delta)
    return model


def _config(kind: str, stage: int, gas: int, offload: str, nvme_path: str) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 150, "allgather_bucket_size": 200,
            "stage3_param_persistence_threshold": 10}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "nvme":
        zero.update(sub_group_size=64, offload_optimizer={"device": "nvme", "nvme_path": nvme_path})
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": kind.lower(), "params": PARAMS[kind]}, "zero_optimization": zero,
            "zero_allow_untested_optimizer": kind == "MuSGD"}


def _train(kind: str, stage: int, gas: int, offload: str, nvme_path: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(),
                                     config=_config(kind, stage, gas, offload, nvme_path))
    for x, y in make_batches(STEPS, MICRO * gas * world):
        for xm, ym in micro_batches(x, y, rank, world, gas):
            eng.backward(eng(xm, ym))
            eng.step()
    out = {"params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()},
           "lrs": sorted({g["lr"] for g in eng.optimizer.param_groups})}
    if offload == "nvme":
        eng.destroy()
    return out


def _runs(nvme_path: str) -> dict:
    return {case: _train(*case, nvme_path) for case in CASES}


def _reference(kind: str, gas: int) -> dict:
    model = make_model()
    opt = getattr(mup, kind)(model.parameters(), **PARAMS[kind])
    for x, y in make_batches(STEPS, MICRO * gas * 2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def two_ranks():
    return optimizer_runs.part(2, "mup")


@pytest.mark.parametrize("kind, stage, gas, offload", CASES, ids=lambda v: str(v))
def test_mup_optimizer_equals_mups_own_class(two_ranks, kind, stage, gas, offload):
    want, start = _reference(kind, gas), dict(make_model().named_parameters())
    for rank, results in enumerate(two_ranks):
        got = results[(kind, stage, gas, offload)]
        assert len(got["lrs"]) >= 2, f"rank {rank}: one lr for every group ({got['lrs']}): no μP scaling"
        for name, w in want.items():
            err = (got["params"][name] - w).abs().max().item()
            assert err < 2e-5, f"rank {rank} {kind} stage {stage} {offload} {name}: max |w - w_ref| = {err:.2e}"
            assert (w - start[name]).abs().max().item() > 1e-3, f"{name}: the reference did not move"


@pytest.mark.parametrize("kind, stage, gas, offload", OFFLOADED, ids=lambda v: str(v))
def test_offloaded_mup_optimizer_equals_no_offload_bit_for_bit(two_ranks, kind, stage, gas, offload):
    for rank, results in enumerate(two_ranks):
        got, want = results[(kind, stage, gas, offload)], results[(kind, stage, gas, "none")]
        assert got["lrs"] == want["lrs"], f"rank {rank}: group lrs {got['lrs']} != {want['lrs']}"
        for name, w in want["params"].items():
            g = got["params"][name]
            assert torch.equal(g, w), f"rank {rank} {kind} {offload} stage {stage} {name}: {(g - w).abs().max():.2e}"


def test_parameters_without_base_shapes_are_a_config_error():
    model = nn.Linear(3, 2)
    with pytest.raises(schemas.ConfigError) as raised:
        engine.initialize(model=model, model_parameters=model.parameters(),
                          config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "muadam"}})
    assert "mup.set_base_shapes(model, base_model)" in raised.value.problems[0], raised.value.problems
