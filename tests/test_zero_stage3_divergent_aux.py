"""ZeRO-3 with a module that runs on some ranks only *inside* a unit (engine/zero/prefetch.py, note:
reductions wait): an auxiliary head owned by the root unit, or a side branch inside one block of a
ModuleList, called only where a row's flag (column -1 of x) is set. Every rank gathers the same units,
so the unit-level checks see no divergence, but the head's parameters get a gradient on the flagged
rank only. That rank reduced the head's gradient bucket mid-backward and waited on it, while the others
launched it only when their backward ended, after the request round that closes it (the recording pass)
or after a plan gather the waiting rank no longer issued (prefetch bucket 0): a hang until the process-
group timeout (found by a differential fuzzer, seeds 106, 171, 173).

Oracle: single-process SGD on the global batch (no clipping: linear in the gradient), fp32 atol 1e-6;
and the reductions wait for the end of backward in exactly the micro-steps whose ranks' flags differ
(the others keep their overlap).
All cases run in one 2-rank spawn; a hang fails at the harness timeout (DSTRAIN_TIMEOUT 20 s for the
process group).
"""
from __future__ import annotations

import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed
from tests.models import micro_batches, reference_train
from tests.test_zero_stage3_plan import LR, MICRO, _config, _masters


class Block(nn.Module):
    def __init__(self, side: bool):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.side = nn.Linear(16, 16) if side else None  # inside this block's unit

    def forward(self, h, flag):
        h = torch.tanh(self.lin(h))
        if self.side is not None and bool(flag.any()):
            h = h + flag[:, None] * torch.tanh(self.side(h))
        return h


class AuxInUnit(nn.Module):
    """`where` "root": the aux head belongs to the root unit; "block": the second block (the first one
    backward reaches) has a side branch."""

    def __init__(self, where: str):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(False), Block(where == "block")])
        self.out = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4) if where == "root" else None

    def forward(self, x, y):
        flag = x[:, -1]
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h, flag)
        per_row = ((self.out(h) - y) ** 2).mean(1)
        if self.aux is not None and bool(flag.any()):
            per_row = per_row + flag * ((self.aux(h) - y) ** 2).mean(1)
        return per_row.mean()


ONE_PER_BUCKET = {"reduce_bucket_size": 16}  # every parameter in a bucket of its own
# name -> (where, per step and micro-step: (rank 0's flag, rank 1's flag), gradient accumulation, zero config)
CASES = {
    # 106: the flagged rank waits (4 in flight) on the head's bucket while the other is in the round
    # that closes the recording pass's backward
    "root_overlap": ("root", [[(0., 1.)]] * 3, 1, {**ONE_PER_BUCKET, "overlap_comm": True}),
    # 173: one bucket, reduced (without overlap) from the last gradient's hook on the flagged rank only
    "root_one_bucket": ("root", [[(1., 0.)]] * 3, 1, {"overlap_comm": False}),
    # 171: accumulation, the head used in micro-step 0 on one rank, every parameter persistent: no gathers,
    # only the round that closes the recording pass's backward, which the other rank waits in
    "root_accumulation": ("root", [[(0., 1.), (0., 0.)]] * 3, 2,
                          {**ONE_PER_BUCKET, "overlap_comm": False, "stage3_param_persistence_threshold": 100000}),
    # on the plan (step 0 records with both ranks flagged; reuse distance 0: backward gathers again): the
    # flagged rank waits on the branch's bucket and never issues the first block's backward gather, which
    # the other rank waits for
    "block_on_plan": ("block", [[(1., 1.)], [(1., 0.)], [(0., 1.)]], 1,
                      {**ONE_PER_BUCKET, "overlap_comm": False, "stage3_prefetch_bucket_size": 0,
                       "stage3_max_reuse_distance": 0}),
}


def _batches(flags: list, gas: int) -> list:
    """Global batches laid out as [micro-step][rank][sample] (tests.models.micro_batches)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in flags:
        x, y = torch.randn(2 * gas * MICRO, 8, generator=g), torch.randn(2 * gas * MICRO, 4, generator=g)
        x[:, -1] = torch.tensor([f for pair in step for f in pair for _ in range(MICRO)])
        out.append((x, y))
    return out


def _train(where: str, flags: list, gas: int, zero: dict) -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = {**_config(zero), "gradient_accumulation_steps": gas}
    eng = engine.initialize(model=AuxInUnit(where), config=config)[0]
    deferred = []
    for x, y in _batches(flags, gas):
        for xm, ym in micro_batches(x, y, rank, 2, gas):
            loss = eng(xm, ym)
            deferred.append(eng.zero_optimizer.coordinator.defer_reductions)
            eng.backward(loss)
            eng.step()
    return {"master": _masters(eng), "deferred": deferred}


def _cases() -> dict:
    return {name: _train(*case) for name, case in CASES.items()}


def test_zero_stage3_divergent_aux():
    results = run_distributed(_cases, 2, timeout=150, env={"DSTRAIN_TIMEOUT": "20"})
    for name, (where, flags, gas, _) in CASES.items():
        torch.manual_seed(0)
        ref, _, _ = reference_train(AuxInUnit(where), _batches(flags, gas), lambda p: torch.optim.SGD(p, lr=LR))
        # reductions wait in the passes whose ranks differ, only there: the others keep their overlap
        differ = [f0 != f1 for step in flags for f0, f1 in step]
        for rank, r in enumerate(results):
            assert r[name]["deferred"] == differ, (name, rank)
            for k, v in ref.named_parameters():
                torch.testing.assert_close(r[name]["master"][k], v.detach(), atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{name} rank {rank} {k}: {m}")
