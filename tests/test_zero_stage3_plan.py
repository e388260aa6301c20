"""ZeRO-3's gather plan, prefetcher and request rounds (engine/zero/prefetch.py, gather_requests.py)
under rank-divergent paths and memory limits.

- An MoE whose experts run only for the tokens they get: a rank skipping the plan's last forward or
  backward units, ranks differing while the order is recorded, a rank leaving the plan in forward, and
  evaluation passes in which the ranks run different experts: each trains (evaluates) exactly.
- `max_reuse_distance` 0 with the default bucket: each unit gathered once in forward and once in
  backward, and the recorded order kept.
- `max_live_parameters`: the peak of gathered and in-flight elements stays within it (units in use
  excepted).
- Gradient buckets of one parameter each, a rank skipping an expert on the plan or in request rounds,
  and a collective of the user's after each forward (`test_zero_stage3_divergent_reductions`).
Each case runs in one 2-rank spawn (`_cases`); a hang fails at the harness timeout. Values are compared
with single-process training on the global batch (SGD, no clipping: the update is linear in the
gradient, so a lost or doubled gradient shows); gather counts come from the coordinator's `gather_log`.
"""
from __future__ import annotations

import pytest
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
        return nn.functional.mse_loss(self.out(self.mix(x, torch.tanh(self.inp(x)))), y)

    def mix(self, x, h):
        route = x[:, -1].long()
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero()[:, 0]
            if len(rows):
                mixed = mixed.index_put((rows,), expert(h[rows]))
        return h + mixed


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


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


ALL = [0., 1., 2.]
# Each case: (the experts each step's tokens reach on rank 0 and on rank 1, zero config, trace dropped
# after each step?). tail_forward: rank 1 skips the last forward units of the plan recorded in step 0;
# tail_backward (max_reuse_distance 0): it skips the last backward unit, whose gather it owes before the
# reduction; from_start: the ranks differ in step 0 too, so no order is kept and every step gathers in
# request rounds (gather_requests.py); unplanned: the order recorded in step 0 has no expert 0 and rank 0
# reaches it in step 1 before experts 1 and 2, whose gathers rank 1 waits on (prefetch.py's note:
# leaving the plan), so step 2 records again.
MOE_CASES = {"tail_forward": ([(ALL, ALL), (ALL, [0., 0., 0.]), (ALL, [0., 0., 0.])], {}, [False] * STEPS),
             "tail_backward": ([(ALL, ALL), (ALL, [1., 2., 2.]), (ALL, [1., 2., 2.])],
                               {"stage3_max_reuse_distance": 0}, [False] * STEPS),
             "from_start": ([(ALL, [0., 0., 0.])] * STEPS, {}, [True] * STEPS),
             "unplanned": ([([1., 2., 2.], [2., 1., 1.]), (ALL, [1., 2., 2.]), ([1., 2., 2.], [2., 1., 1.])], {},
                           [False, True, False])}


def _moe_batches(routes: list) -> list:
    """Global batches (rank 0's rows, then rank 1's) whose tokens reach the experts `routes` says."""
    g = torch.Generator().manual_seed(0)
    out = []
    for rank0, rank1 in routes:
        x, y = torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 4, generator=g)
        x[:, -1] = torch.tensor(rank0 + rank1)
        out.append((x, y))
    return out


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _masters(eng) -> dict:
    return {k: safe_get_full_fp32_param(p).clone() for k, p in eng.module.named_parameters()}


def _moe_divergent(routes: list, zero: dict, _dropped: list) -> dict:
    """A prefetch bucket (300) smaller than the rest of the model: the other rank's prefetch waits on the
    skipped experts' gathers (prefetch.py's note: the whole plan on every rank)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=MoE(), config=_config({"stage3_prefetch_bucket_size": 300, **zero}))[0]
    co, dropped = eng.zero_optimizer.coordinator, []
    for x, y in _moe_batches(routes):
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


# Evaluation passes: rank 0's tokens reach every expert, rank 1's only these (gather_requests.py's note).
EVAL_ROUTES = [[0., 0., 0.], [2., 2., 2.], [1., 0., 1.]]


def _eval_inputs(rank: int) -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for route in EVAL_ROUTES:
        x, y = torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 4, generator=g)
        x[:, -1] = torch.tensor([0., 1., 2.] + route)
        out.append((x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
    return out


def _moe_evaluation() -> dict:
    """Generation-style no_grad passes in which the ranks run different experts, then a training step."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng = engine.initialize(model=MoE(), config=_config({}))[0]
    eng.module.eval()
    with torch.no_grad():
        losses = [float(eng(x, y)) for x, y in _eval_inputs(rank)]
    eng.module.train()
    x, y = _moe_batches([(ALL, [0., 0., 0.])])[0]
    for xm, ym in micro_batches(x, y, rank, 2, 1):
        eng.backward(eng(xm, ym))
    eng.step()
    return {"losses": losses, "master": _masters(eng)}


def _cases() -> dict:
    out = {name: _moe_divergent(*case) for name, case in MOE_CASES.items()}
    out.update({f"live{n}": _live_limited(n) for n in LIVE_CASES})
    return {**out, "reuse0": _reuse0_default_bucket(), "eval": _moe_evaluation()}


def test_zero_stage3_plan():
    results = run_distributed(_cases, 2, timeout=90)
    for name, (routes, _, dropped) in MOE_CASES.items():
        _check_moe_divergent([r[name] for r in results], _moe_batches(routes), dropped)
    _check_reuse0([r["reuse0"] for r in results])
    _check_moe_evaluation([r["eval"] for r in results])
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


def _check_moe_divergent(results: list, batches: list, dropped: list) -> None:
    torch.manual_seed(0)
    _check_masters(results, MoE(), batches)
    for rank, r in enumerate(results):
        assert r["dropped"] == dropped, (rank, r["dropped"])  # skipping units stays on the plan


def _check_reuse0(results: list) -> None:
    layers = [f"layers.{i}" for i in range(4)]
    for rank, steps in enumerate(results):
        for step, (fwd, bwd, dropped) in enumerate(steps):
            assert (fwd, bwd, dropped) == (layers, layers[::-1], False), (rank, step, fwd, bwd, dropped)


def _check_moe_evaluation(results: list) -> None:
    torch.manual_seed(0)
    model = MoE().eval()
    for rank, r in enumerate(results):
        with torch.no_grad():
            want = [float(model(x, y)) for x, y in _eval_inputs(rank)]
        assert r["losses"] == pytest.approx(want, abs=1e-6), (rank, r["losses"], want)
    torch.manual_seed(0)
    _check_masters(results, MoE(), _moe_batches([(ALL, [0., 0., 0.])]))


class DeepMoE(MoE):
    """MoE with layers between `inp` and the experts: after an expert's backward, units still gather."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(self.mix(x, h)), y)


# (routes, zero config): buckets of one parameter each, so a bucket holding the gradient of an expert that
# one rank skipped is reduced mid-backward on the other rank (prefetch.py's note: reductions wait).
# on_plan: rank 1 skips expert 2, the first in backward, on the plan (max_reuse_distance 0: the layers
# after it gather again in backward); by_request: the ranks differ from step 0, so every pass gathers in
# request rounds, and a logged loss's all-reduce runs between forward and backward.
REDUCTION_CASES = {"on_plan": ([(ALL, ALL), (ALL, [0., 1., 1.]), (ALL, [0., 1., 1.])],
                               {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 300,
                                "reduce_bucket_size": 16}),
                   "by_request": ([(ALL, [0., 0., 0.])] * STEPS, {"reduce_bucket_size": 300, "overlap_comm": True})}


def _divergent_reductions() -> dict:
    rank, out = torch.distributed.get_rank(), {}
    for name, (routes, zero) in REDUCTION_CASES.items():
        torch.manual_seed(0)
        eng = engine.initialize(model=DeepMoE(), config=_config(zero))[0]
        for x, y in _moe_batches(routes):
            for xm, ym in micro_batches(x, y, rank, 2, 1):
                loss = eng(xm, ym)
                torch.distributed.all_reduce(loss.detach().clone())  # logging; the other rank may still gather
                eng.backward(loss)
            eng.step()
        out[name] = {"master": _masters(eng)}
    eng.eval()  # an evaluation forward with gradients enabled, then a collective of the user's
    x, y = _moe_batches([(ALL, [0., 0., 0.])])[0]
    losses = [float(eng(xm, ym)) for xm, ym in micro_batches(x, y, rank, 2, 1)]
    torch.distributed.all_reduce(torch.tensor(losses))
    return out


def test_zero_stage3_divergent_reductions():
    """A rank that skipped an expert reduces its bucket only when its backward ends: the other ranks
    must not wait on that reduction mid-backward while it still needs their gathers (it hung until the
    process-group timeout), and request rounds end with each forward (a collective of the user's after it
    hung)."""
    results = run_distributed(_divergent_reductions, 2, timeout=90, env={"DSTRAIN_TIMEOUT": "20"})
    for name, (routes, _) in REDUCTION_CASES.items():
        torch.manual_seed(0)
        _check_masters([r[name] for r in results], DeepMoE(), _moe_batches(routes))
