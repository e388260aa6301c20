"""ZeRO-3 backward anchors for units inside a reentrant activation checkpoint (engine/zero/anchors.py, note:
reentrant regions).

`CkptAuxNet` is tests/test_zero_stage3_backward_paths.py's AuxNet with its auxiliary head called inside a
reentrant region: torch.utils.checkpoint(..., use_reentrant=True) or engine.checkpointing.checkpoint. The
head's forward runs without gradients there, so its output could not be anchored, and its backward
(recompute included) ran only on the ranks whose loss used it. Before: late_use hung until the harness
killed it (no rank raised); skip_on_plan and recording aborted a rank in gloo (the other: "Connection
closed by peer"); and once the region was anchored, the first backward of the rank whose loss skipped the
head did not see the region in the loss's graph, launched its buckets mid-backward while the other held
them, and timed out (recording). "same": every rank's flags agree, with and without the head.
Oracle: single-process SGD on the global batch (no clipping: linear in the gradient), fp32 atol 1e-6.
All cases run in one 2-rank spawn; DSTRAIN_TIMEOUT 20 s for the process group.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed
from tests.models import micro_batches, reference_train
from tests.test_zero_stage3_backward_paths import AUX_CASES, _assert_masters, _aux_batches
from tests.test_zero_stage3_plan import LR, _config, _masters

CASES = {**{name: flags for name, (flags, _) in AUX_CASES.items()}, "same": [(1., 1.), (0., 0.), (1., 1.)]}
ZERO = {name: zero for name, (_, zero) in AUX_CASES.items()}
REGIONS = ("torch", "dstrain")


class CkptAuxNet(nn.Module):
    def __init__(self, region: str | None):
        super().__init__()
        self.region = region
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def _aux(self, h: torch.Tensor) -> torch.Tensor:
        if self.region == "torch":
            return torch.utils.checkpoint.checkpoint(self.heads[1], h, use_reentrant=True)
        if self.region == "dstrain":
            return engine.checkpointing.checkpoint(self.heads[1], h)
        return self.heads[1](h)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        main, aux = self.heads[0](h), self._aux(h)
        per_row = ((main - y) ** 2).mean(1)
        if bool(x[:, -1].any()):  # a row's aux term counts where its flag is set
            per_row = per_row + x[:, -1] * ((aux - y) ** 2).mean(1)
        return per_row.mean()


def _train(region: str, flags: list, zero: dict) -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=CkptAuxNet(region), config=_config(zero))[0]
    for x, y in _aux_batches(flags):
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            eng.backward(eng(xm, ym))
        eng.step()
    masters = _masters(eng)
    eng.destroy()
    return masters


def _wrapped() -> bool:
    return "apply" in torch.utils.checkpoint.CheckpointFunction.__dict__


def _raised_then_destroyed() -> tuple[bool, bool]:
    """(wrapped after a forward that raised past a region, wrapped after destroy): the root's always-called
    hook removes the wrapper when the forward raises (stage3_units.install_hooks)."""
    eng = engine.initialize(model=CkptAuxNet("torch"), config=_config({}))[0]
    x, y = _aux_batches([(1., 1.)])[0]
    try:
        eng(x[:3], y[:2])  # the loss's shapes disagree after the region ran
    except RuntimeError:
        pass
    raised = _wrapped()
    eng.destroy()
    return raised, _wrapped()


def _cases() -> dict:
    out = {(region, name): _train(region, flags, ZERO.get(name, {})) for region in REGIONS
           for name, flags in CASES.items()}
    out["wrapped_after_training"] = _wrapped()
    out["raised"] = _raised_then_destroyed()
    return out


def test_units_in_reentrant_regions_run_backward_on_every_rank():
    results = run_distributed(_cases, 2, timeout=240, env={"DSTRAIN_TIMEOUT": "20"})
    for name, flags in CASES.items():
        torch.manual_seed(0)
        ref, _, _ = reference_train(CkptAuxNet(None), _aux_batches(flags), lambda p: torch.optim.SGD(p, lr=LR))
        for rank, r in enumerate(results):
            assert not r["wrapped_after_training"] and r["raised"] == (False, False), r["raised"]
            for region in REGIONS:
                _assert_masters(r[(region, name)], ref, f"{region} {name} rank {rank}")
