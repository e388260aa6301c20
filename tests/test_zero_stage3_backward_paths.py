"""ZeRO-3 backward passes whose units differ between ranks from their forward's (engine/zero/prefetch.py,
notes: anchors, a backward outside its pass).

- `AuxNet`: every unit runs forward on every rank, but the auxiliary head's loss term counts only for
  batches flagged in column -1, so its output reaches the loss on some ranks only (backward-only
  divergence). late_use: no rank used it while the order was recorded, then rank 0 does (it gathered off
  the plan against rank 1's plan gathers: a hang); skip_on_plan: rank 1 stops using it once the plan has
  it, with a small prefetch bucket and one-parameter buckets without overlap (rank 0 waited on the aux
  head's reduction mid-backward); recording: the ranks differ from the first pass (gloo aborted).
- `MoE` (tests/test_zero_stage3_plan.py) with an evaluation forward between a training forward and its
  backward, under torch.no_grad() or in eval mode with gradients: the ranks run different experts in
  the backward that follows (it raised RankDivergenceError), also while the order is recorded and on a
  plan.
Oracle: single-process SGD on the global batch (no clipping: linear in the gradient), fp32 atol 1e-6, and
the evaluation losses of the plain model at the same step. Each case runs in one 2-rank spawn; a hang
fails at the harness timeout (DSTRAIN_TIMEOUT 20 s for the process group).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed
from tests.models import micro_batches, reference_train
from tests.test_zero_stage3_plan import ALL, LR, MICRO, MoE, _config, _masters, _moe_batches


class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        main, aux = self.heads[0](h), self.heads[1](h)
        per_row = ((main - y) ** 2).mean(1)
        if bool(x[:, -1].any()):  # a row's aux term counts where its flag is set: a mean over rows
            per_row = per_row + x[:, -1] * ((aux - y) ** 2).mean(1)
        return per_row.mean()


# name -> (per step: (rank 0's flag, rank 1's flag), zero config)
AUX_CASES = {"late_use": ([(0., 0.), (1., 0.), (1., 0.)], {}),
             "skip_on_plan": ([(1., 1.), (1., 0.), (1., 0.)],
                              {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 300,
                               "reduce_bucket_size": 16, "overlap_comm": False}),
             "recording": ([(1., 0.)] * 3, {"reduce_bucket_size": 16, "overlap_comm": False})}

# MoE steps: (experts rank 0's and rank 1's tokens reach, the evaluation forward before backward).
# Step 0's recording is cut by the evaluation (dropped), step 1 records with the ranks differing (not
# kept), step 2 records a plan, steps 3-5 run on it with rank 1 skipping experts.
DIVERGE = (ALL, [0., 0., 0.])
EVAL_STEPS = [((ALL, ALL), "no_grad"), (DIVERGE, None), ((ALL, ALL), None), (DIVERGE, "no_grad"),
              (DIVERGE, "eval_mode"), (DIVERGE, None)]


def _aux_batches(flags: list) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for f0, f1 in flags:
        x, y = torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 4, generator=g)
        x[:, -1] = torch.tensor([f0] * MICRO + [f1] * MICRO)
        out.append((x, y))
    return out


def _train_aux(flags: list, zero: dict) -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=AuxNet(), config=_config(zero))[0]
    for x, y in _aux_batches(flags):
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            eng.backward(eng(xm, ym))
        eng.step()
    return _masters(eng)


def _evaluate(eng, x, y, kind: str) -> float:
    if kind == "no_grad":
        with torch.no_grad():
            return float(eng(x, y))
    eng.eval()  # eval mode, gradients enabled: a pass of its own that is not a training pass
    try:
        return float(eng(x, y))
    finally:
        eng.train()


def _train_with_evaluations() -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=MoE(), config=_config({}))[0]
    losses = []
    for (x, y), (_, kind) in zip(_moe_batches([r for r, _ in EVAL_STEPS]), EVAL_STEPS):
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            loss = eng(xm, ym)
            if kind is not None:
                losses.append(_evaluate(eng, xm, ym, kind))
            eng.backward(loss)
        eng.step()
    return {"master": _masters(eng), "losses": losses}


def _cases() -> dict:
    out = {name: _train_aux(*case) for name, case in AUX_CASES.items()}
    out["evaluations"] = _train_with_evaluations()
    return out


def _reference_evaluations() -> tuple:
    """The plain model trained on the global batches, and each rank's evaluation losses on the way."""
    torch.manual_seed(0)
    model = MoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = [[], []]
    for (x, y), (_, kind) in zip(_moe_batches([r for r, _ in EVAL_STEPS]), EVAL_STEPS):
        for rank in range(2):
            if kind is not None:
                xm, ym = next(micro_batches(x, y, rank, 2, 1))
                with torch.no_grad():
                    losses[rank].append(float(model(xm, ym)))
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, losses


def _assert_masters(master: dict, model: nn.Module, what: str) -> None:
    for k, v in model.named_parameters():
        torch.testing.assert_close(master[k], v.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"{what} {k}: {m}")


def test_zero_stage3_backward_paths():
    results = run_distributed(_cases, 2, timeout=120, env={"DSTRAIN_TIMEOUT": "20"})
    for name, (flags, _) in AUX_CASES.items():
        torch.manual_seed(0)
        ref, _, _ = reference_train(AuxNet(), _aux_batches(flags), lambda p: torch.optim.SGD(p, lr=LR))
        for rank, r in enumerate(results):
            _assert_masters(r[name], ref, f"{name} rank {rank}")
    model, losses = _reference_evaluations()
    for rank, r in enumerate(results):
        _assert_masters(r["evaluations"]["master"], model, f"evaluations rank {rank}")
        assert r["evaluations"]["losses"] == pytest.approx(losses[rank], abs=1e-6), rank
