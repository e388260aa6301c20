"""ZeRO stage 3 is exactly single-process training on the global batch, and holds and moves what the
ZeRO paper says (arXiv:1910.02054 §5, §7).

Models: tests.models.OddMLP (odd sizes, a 1-element and a frozen parameter, two param groups); a tiny
examples.gpt.GPT (embedding tied to the LM head, blocks in a ModuleList: one unit each); `Twice`, whose
ModuleList layer 1 runs twice per forward and whose root uses a parameter outside its module's forward.
fp32: atol 1e-6 (only summation order differs). fp16/bf16: forward and backward run in 16 bits, so as
in tests/test_zero_stage1_2.py we bound each fp32 master tensor's relative error ||w - w_ref|| /
||w_ref|| (measured on the GPT after 6 steps with torch 2.13.0 CPU: fp16 up to 1.7e-1 on the layer-norm biases,
which start at zero and whose small gradients Adam normalises to ±lr steps, 1.1e-2 on pos.weight;
bf16 5.0e-2; the same at stage 0, so it is the precision's and not stage 3's; MIXED_RTOL is a bound on
gross errors only). Such a bound cannot see a wrong
gradient scale (Adam is invariant to it; tests/test_zero_exactness.py's SGD oracles can). So both are also held to stage 0 in the same precision: both reduce
the same 16-bit gradients, only in a different order (measured 0 to 4 digits; bound 2e-3).
Small `reduce_bucket_size`, `max_reuse_distance` 0 and a small `prefetch_bucket_size` make every step
gather twice, prefetch and reduce in several buckets; the default (keep for reuse) runs once too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine.utils import safe_get_full_fp32_param
from examples.gpt import GPT, GPTConfig
from tests.harness import RankFailed, run_distributed
from tests.models import OddMLP, make_batches, micro_batches, reference_train

STEPS = 6
MICRO = 2
CLIP = 0.5
MIXED_RTOL = {"fp16": 0.3, "bf16": 0.3}
TINY = GPTConfig(vocab_size=50, seq_len=8, n_layer=2, n_head=2, d_model=16)
STRICT = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 3000, "reduce_bucket_size": 2000,
          "stage3_param_persistence_threshold": 20}


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 24)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.out = nn.Linear(24, 5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for i in (0, 1, 1, 2):  # layer 1 twice
            h = torch.tanh(self.layers[i](h))
        out = self.out(h) + h[:, :5] @ self.inp.weight[:5, :5]  # a parameter outside its module's forward
        return nn.functional.mse_loss(out, y)


class Reader(nn.Module):
    """A block that also reads another block's weight, registered as DeepSpeed users do."""

    def __init__(self, other: nn.Linear):
        super().__init__()
        self.lin = nn.Linear(24, 24)
        self.other = [other]  # a plain list: not a child, so `other` is not owned here
        engine.zero.register_external_parameter(self, other.weight)

    def forward(self, h):
        return self.lin(h) + h @ self.other[0].weight.t()


class External(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 24)
        first = nn.Linear(24, 24)
        self.layers = nn.ModuleList([first, Reader(first)])
        self.out = nn.Linear(24, 5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h), y)


def _gpt_batches(steps: int, batch: int):
    g = torch.Generator().manual_seed(0)
    return [(lambda d: (d[:, :-1], d[:, 1:]))(torch.randint(0, TINY.vocab_size, (batch, TINY.seq_len + 1),
                                                            generator=g)) for _ in range(steps)]


MODELS = {"mlp": (OddMLP, make_batches), "gpt": (lambda: GPT(TINY), _gpt_batches),
          "twice": (Twice, make_batches), "external": (External, make_batches)}


def _config(gas: int, precision: str, zero: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, **zero}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(model_name: str, gas: int, precision: str, zero: dict):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    make_model, make_data = MODELS[model_name]
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=make_model(), config=_config(gas, precision, zero))
    for x, y in make_data(STEPS, MICRO * gas * world):
        for xm, ym in micro_batches(x, y, rank, world, gas):
            eng.backward(eng(xm, ym))
            eng.step()
    with torch.no_grad():  # evaluation between steps: no trace, no leak
        eng.module.eval()
        eval_loss = float(eng(*make_data(1, MICRO)[0]))
        eng.module.train()
    coordinator = getattr(eng.zero_optimizer, "coordinator", None)
    if coordinator is not None:  # nothing left gathered or in flight after evaluation
        assert not any(g.gathered for g in coordinator.groups) and not coordinator.pending
    return {"master": {k: safe_get_full_fp32_param(p) for k, p in eng.module.named_parameters()},
            "eval_loss": eval_loss, "norm": eng.get_global_grad_norm()}


def _reference(model_name: str, world: int, gas: int):
    make_model, make_data = MODELS[model_name]
    torch.manual_seed(0)
    ref, _, _ = reference_train(make_model(), make_data(STEPS, MICRO * gas * world),
                                lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), clip=CLIP)
    with torch.no_grad():
        ref.eval()
        eval_loss = float(ref(*make_data(1, MICRO)[0]))
    return ref, eval_loss


def _comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """The attention key bias (qkv.bias[d:2d]) has a gradient of exactly zero in exact arithmetic
    (softmax is invariant to adding q·b to every score), so Adam turns rounding noise into ±lr steps
    there in every implementation, the reference included: it is no measure of parity."""
    if name.endswith("qkv.bias"):
        d = t.shape[0] // 3
        return torch.cat([t[:d], t[2 * d:]])
    return t


def _check(results: list, case: tuple, world: int, same_precision_stage0: list | None = None) -> None:
    model_name, gas, precision, _ = case
    ref, ref_eval = _reference(model_name, world, gas)
    want = {k: v for k, v in ref.named_parameters()}
    for r in results:
        got = {k: v for k, v in r["master"].items() if v is not None}
        assert set(got) == {k for k, v in want.items() if v.requires_grad}
        for k, v in got.items():
            if precision == "fp32":
                torch.testing.assert_close(_comparable(k, v), _comparable(k, want[k]), atol=1e-6, rtol=1e-5, msg=lambda m: f"{case} {k}: {m}")
            else:
                a, b = _comparable(k, v), _comparable(k, want[k].detach())
                rel = float((a - b).norm() / b.norm())
                assert rel < MIXED_RTOL[precision], (case, k, rel)
        if precision == "fp32":
            assert abs(r["eval_loss"] - ref_eval) < 1e-5, (case, r["eval_loss"], ref_eval)
        assert r["norm"] == results[0]["norm"] and r["norm"] > 0
    for r, r0 in zip(results, same_precision_stage0 or []):
        for k, v in r["master"].items():
            if v is not None:
                a, b = _comparable(k, v), _comparable(k, r0["master"][k])
                assert float((a - b).norm() / b.norm()) < 2e-3, k


CASES_2 = [("mlp", 1, "fp32", STRICT), ("mlp", 2, "fp32", {}), ("gpt", 1, "fp32", STRICT),
           ("gpt", 2, "fp32", {"stage3_param_persistence_threshold": 20}), ("twice", 1, "fp32", STRICT),
           ("external", 1, "fp32", STRICT),
           ("gpt", 1, "fp16", STRICT), ("gpt", 1, "fp16", {"stage": 0}), ("gpt", 1, "bf16", STRICT),
           ("gpt", 1, "bf16", {"stage": 0})]
CASES_4 = [("gpt", 1, "fp32", STRICT), ("twice", 2, "fp32", STRICT)]


def _train_cases(cases):
    return [_train(*case) for case in cases]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_zero_stage3_matches_single_process(world, cases):
    results = run_distributed(_train_cases, world, args=(cases,), timeout=150)
    for i, case in enumerate(cases):
        if case[3].get("stage") == 0:
            continue  # the same-precision baseline
        stage0 = [results[r][cases.index(case[:3] + ({"stage": 0},))] for r in range(world)] \
            if case[2] != "fp32" else None
        _check([results[r][i] for r in range(world)], case, world, stage0)


class EqualLayers(nn.Module):
    """Three equal layers and nothing else, so every gather has the same size."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(13, 13) for _ in range(3))


def _gather_different_layers():
    """Outside a pass: rank 0 gathers layers.1 and rank 1 layers.2 (GatheredParameters is a collective)."""
    torch.manual_seed(0)
    cfg = _config(1, "fp32", {"stage3_param_persistence_threshold": 0})
    eng, _, _, _ = engine.initialize(model=EqualLayers(), config=cfg)
    with engine.zero.GatheredParameters(eng.module.layers[1 + torch.distributed.get_rank()].weight):
        pass


def test_rank_divergent_gathered_parameters_names_the_modules():
    """Rank-divergent passes gather in request rounds and run each rank's own path
    (tests/test_zero_stage3_plan.py); GatheredParameters on different parameters is an error naming both."""
    with pytest.raises(RankFailed) as info:
        run_distributed(_gather_different_layers, 2, timeout=60)
    text = str(info.value)
    assert "RankDivergenceError" in text and "'layers.1'" in text and "'layers.2'" in text, text


def test_host_memory_trimmer_trims_only_past_the_steady_state(monkeypatch):
    from engine.zero.stage3 import HostMemoryTrimmer
    monkeypatch.delenv("DSTRAIN_KEEP_MALLOC", raising=False)
    trimmer = HostMemoryTrimmer(limit=100)
    if trimmer._trim is None:
        pytest.skip("no glibc malloc_trim here")
    calls = []
    trimmer._trim = lambda pad: calls.append(pad)
    readings = iter([500, 900, 880, 950, 999, 1001, 700])  # warm-up sets the level to 900
    trimmer._rss = lambda: next(readings)
    for _ in range(7):
        trimmer()
    assert trimmer.floor == 900 and calls == [0] and trimmer.trims == 1  # only 1001 > 900 + 100


def _forward_inside_gathered() -> dict:
    """ZeRO-3, nothing persistent: inside GatheredParameters(modifier_rank=0) a no_grad forward (a generation
    step with the weights gathered), then rank 0 halves the weight; and a training step after the block."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    eng = engine.initialize(model=model, config=cfg)[0]
    w = eng.module[0].weight
    was = safe_get_full_fp32_param(w).clone()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    with engine.zero.GatheredParameters([w], modifier_rank=0):
        with torch.no_grad():
            eng(x)
        shape_inside = tuple(w.shape)
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():
                w.mul_(0.5)
    out = {"inside": shape_inside, "after": w.numel(), "edited": torch.equal(safe_get_full_fp32_param(w), was * 0.5)}
    eng.backward(eng(x).sum())
    eng.step()
    out["trained"] = bool(torch.isfinite(safe_get_full_fp32_param(w)).all())
    eng.destroy()
    return out


def test_a_forward_inside_gathered_parameters_keeps_them_gathered_and_the_edit():
    """prefetch.py's user_held: the pass a forward makes inside the block released the block's parameters
    (placeholders inside it; with modifier_rank the exit then failed and the edit was lost)."""
    from tests.harness import run_distributed
    for rank, got in enumerate(run_distributed(_forward_inside_gathered, 2, timeout=120)):
        assert got == {"inside": (16, 16), "after": 0, "edited": True, "trained": True}, (rank, got)


def _train_inside_gathered(reuse: int) -> list:
    """Step 0 records the order; step 1 runs forward and backward inside GatheredParameters(modifier_rank=0)
    of the first layer's weight, halved first; then the step. Returns the fp32 parameters after it."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    eng = engine.initialize(model=_held_model(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": reuse}})[0]
    rank, w = torch.distributed.get_rank(), eng.module[0].weight
    for step, (x, y) in enumerate(_held_batches()):
        xm, ym = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        with engine.zero.GatheredParameters([w] if step == 1 else [], modifier_rank=0):
            if step == 1:
                with torch.no_grad():
                    w.mul_(0.5)
            eng.backward(torch.nn.functional.mse_loss(eng(xm), ym))
        eng.step()
    return [safe_get_full_fp32_param(p).clone() for p in eng.module.parameters()]


def _held_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())


def _held_batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(2)]


@pytest.mark.parametrize("reuse", [0, 10**9])
def test_a_training_step_inside_gathered_parameters_keeps_the_edit(reuse):
    """The plan's gather of a group a GatheredParameters block holds was unpacked over the block's values:
    forward or backward ran with the weight before the edit, and the exit stored that (the edit was lost)."""
    from tests.harness import run_distributed
    torch.manual_seed(0)
    model = _held_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_held_batches()):
        if step == 1:
            with torch.no_grad():
                model[0].weight.mul_(0.5)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(run_distributed(_train_inside_gathered, 2, args=(reuse,), timeout=120)):
        for p, want in zip(got, model.parameters()):
            torch.testing.assert_close(p, want.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"rank {rank}: {m}")
