"""mup's base shapes on a model built in engine.zero.Init (engine/mup_optimizers.py, note: base shapes of a
model built in zero.Init). `mup.set_base_shapes` reads `p.shape`, which for a partitioned parameter is its
placeholder's (0, *rest): the first layer's width_mult came out 0 (MuSGD's lr for it times 0) and the
readout's finite output dim a width, silently. initialize refuses such base shapes naming the way out;
set_base_shapes called inside GatheredParameters(..., modifier_rank=0), as the message says, gives every
parameter the plain model's infshape, and 3 steps of MuSGD (no momentum: linear in the gradient) at
ZeRO-3 on 2 ranks equal single-process mup.MuSGD on the global batch, fp32 atol 1e-6."""
from __future__ import annotations

import mup
import torch

import engine
import schemas
from tests.harness import run_distributed
from tests.models import make_batches, micro_batches
from tests.test_mup_optimizers import MupNet

LR, STEPS = 0.1, 3
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "MuSGD", "params": {"lr": LR}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _infshapes(model) -> dict:
    return {n: [(d.base_dim, d.dim) for d in p.infshape] for n, p in model.named_parameters()}


def _built_in_init(gathered: bool):
    torch.manual_seed(0)
    with engine.zero.Init(config=CONFIG):
        model = MupNet(12)
    base, delta = MupNet(4), MupNet(6)
    if gathered:
        with engine.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            mup.set_base_shapes(model, base, delta=delta)
    else:
        mup.set_base_shapes(model, base, delta=delta)
    return model


def _on_rank(batches) -> dict:
    rank = torch.distributed.get_rank()
    try:
        engine.initialize(model=_built_in_init(False), config=CONFIG)
        refusal = "no error"
    except schemas.ConfigError as err:
        refusal = err.problems[0]
    model = _built_in_init(True)
    shapes = _infshapes(model)
    eng = engine.initialize(model=model, config=CONFIG)[0]
    for x, y in batches:
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            eng.backward(eng(xm, ym))
        eng.step()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        trained = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    return {"refusal": refusal, "shapes": shapes, "trained": trained}


def test_base_shapes_of_a_model_built_in_init_are_refused_or_read_whole():
    batches = make_batches(STEPS, 4)
    torch.manual_seed(0)
    plain = MupNet(12)
    mup.set_base_shapes(plain, MupNet(4), delta=MupNet(6))
    opt = mup.MuSGD(plain.parameters(), lr=LR)
    for x, y in batches:
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in run_distributed(_on_rank, 2, args=(batches,), timeout=120):
        assert "set_base_shapes read the empty placeholder" in r["refusal"] and \
            "GatheredParameters(list(model.parameters()), modifier_rank=0)" in r["refusal"], r["refusal"]
        assert r["shapes"] == _infshapes(plain), (r["shapes"], _infshapes(plain))
        for n, p in plain.named_parameters():
            torch.testing.assert_close(r["trained"][n], p.detach(), rtol=0, atol=1e-6, msg=n)
