"""ZeRO-3's gather plan and prefetcher (engine/zero/prefetch.py) under data-dependent paths and limits.

Each case runs in one 2-rank spawn (`_cases`); a hang fails at the harness timeout. Values are compared
with single-process training on the global batch (SGD, no clipping: the update is linear in the
gradient, so a lost or doubled gradient shows); gather counts come from the coordinator's `gather_log`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import engine
from engine.utils import safe_get_full_fp32_param
from tests.harness import run_distributed
from tests.models import micro_batches, reference_train

MICRO, STEPS, LR = 3, 3, 0.1


class MoE(nn.Module):
    """Experts called only for the tokens routed to them (column -1 of x): an expert no token of a
    rank reaches is not called on that rank."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        route = x[:, -1].long()
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero()[:, 0]
            if len(rows):
                mixed = mixed.index_put((rows,), expert(h[rows]))
        return nn.functional.mse_loss(self.out(h + mixed), y)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


# Rank 1's experts after step 0: expert 0 only skips the last forward units of the plan; experts 1 and 2
# only, with max_reuse_distance 0, skip the last backward unit (its gather is owed before the reduction).
MOE_CASES = {"tail_forward": ([0., 0., 0.], {}), "tail_backward": ([1., 2., 2.], {"stage3_max_reuse_distance": 0})}


class Stack(nn.Module):
    """The root owns `inp` and `out` (212 elements) and is in use through the whole forward; each layer 272."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h), y)


# max_live_parameters -> the most elements gathered or in flight at once: the root and one layer (484)
# when 600 leaves no room for a kept or prefetched layer; a limit below the units in use still gathers them.
LIVE_CASES = {600: 484, 100: 484}


def _moe_batches(rank1_route: list):
    """Step 0 (the recorded trace): both ranks reach every expert; later rank 1's tokens take `rank1_route`."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 4, generator=g)
        x[:, -1] = torch.tensor([0., 1., 2.] * 2 if step == 0 else [0., 1., 2.] + rank1_route)
        out.append((x, y))
    return out


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _masters(eng) -> dict:
    return {k: safe_get_full_fp32_param(p).clone() for k, p in eng.module.named_parameters()}


def _moe_skipping_the_tail(rank1_route: list, zero: dict) -> dict:
    """A prefetch bucket (300) smaller than the rest of the model: the other rank's prefetch waits on the
    skipped experts' gathers (prefetch.py's note: the whole plan on every rank)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=MoE(), config=_config({"stage3_prefetch_bucket_size": 300, **zero}))[0]
    co, dropped = eng.zero_optimizer.coordinator, []
    for x, y in _moe_batches(rank1_route):
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            eng.backward(eng(xm, ym))
        dropped.append(co.trace is None)
        eng.step()
    return {"master": _masters(eng), "dropped": dropped}


def _reuse0_default_bucket() -> list:
    """`max_reuse_distance` 0, the default bucket: (forward, backward) gathers per step, trace dropped?"""
    torch.manual_seed(0)
    eng = engine.initialize(model=Chain(), config=_config({"stage3_max_reuse_distance": 0}))[0]
    co, out = eng.zero_optimizer.coordinator, []
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        eng.backward(eng(torch.randn(MICRO, 16, generator=g), torch.randn(MICRO, 16, generator=g)))
        out.append(([n for p, n in co.gather_log if p == "F"], [n for p, n in co.gather_log if p == "B"],
                    co.trace is None))
        eng.step()
    return out


def _stack_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 4, generator=g)) for _ in range(STEPS)]


def _live_limited(max_live: int) -> dict:
    """Train Stack with the default reuse distance and prefetch bucket: the peak of gathered and in-flight
    elements each step, seen at every unpack."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=Stack(), config=_config({"stage3_max_live_parameters": max_live}))[0]
    co, peak = eng.zero_optimizer.coordinator, [0]

    def watch(g, unpack):
        def counted(out):
            unpack(out)
            peak[0] = max(peak[0], sum(h.numel for h in co.groups if h.gathered or h.gid in co.pending))
        return counted
    for g in co.groups:
        g.unpack = watch(g, g.unpack)
    peaks = []
    for x, y in _stack_batches():
        peak[0] = 0
        for xm, ym in micro_batches(x, y, rank, 2, 1):
            eng.backward(eng(xm, ym))
        peaks.append(peak[0])
        eng.step()
    return {"master": _masters(eng), "peaks": peaks}


def _cases() -> dict:
    out = {name: _moe_skipping_the_tail(*case) for name, case in MOE_CASES.items()}
    out.update({f"live{n}": _live_limited(n) for n in LIVE_CASES})
    return {**out, "reuse0": _reuse0_default_bucket()}


def test_zero_stage3_plan():
    results = run_distributed(_cases, 2, timeout=90)
    for name, (route, _) in MOE_CASES.items():
        _check_moe_tail([r[name] for r in results], route)
    _check_reuse0([r["reuse0"] for r in results])
    for limit, peak in LIVE_CASES.items():
        _check_live([r[f"live{limit}"] for r in results], peak)


def _check_masters(results: list, model: nn.Module, batches: list) -> None:
    ref, _, _ = reference_train(model, batches, lambda p: torch.optim.SGD(p, lr=LR))
    for rank, r in enumerate(results):
        for k, v in ref.named_parameters():
            torch.testing.assert_close(r["master"][k], v.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"{rank} {k}: {m}")


def _check_live(results: list, peak: int) -> None:
    torch.manual_seed(0)
    _check_masters(results, Stack(), _stack_batches())
    for rank, r in enumerate(results):
        assert r["peaks"] == [peak] * STEPS, (rank, r["peaks"])


def _check_moe_tail(results: list, route: list) -> None:
    torch.manual_seed(0)
    _check_masters(results, MoE(), _moe_batches(route))
    for rank, r in enumerate(results):
        assert r["dropped"] == [False] * STEPS, (rank, r["dropped"])  # skipping units stays on the plan


def _check_reuse0(results: list) -> None:
    layers = [f"layers.{i}" for i in range(4)]
    for rank, steps in enumerate(results):
        for step, (fwd, bwd, dropped) in enumerate(steps):
            assert (fwd, bwd, dropped) == (layers, layers[::-1], False), (rank, step, fwd, bwd, dropped)
