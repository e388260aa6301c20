"""Optimizers: config -> torch class and hyperparameters, DeepSpeed's Adam/AdamW semantics checked
numerically, user-supplied optimizers, and bad configs rejected with the key's path."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import engine
import ops
import schemas

from engine.optimizers import (ZERO_SUPPORTED_OPTIMIZERS, build_optimizer, is_zero_supported_optimizer,
                               resolve_optimizer)
from schemas.optimizer import NOT_BUILT_OPTIMIZERS, OptimizerConfig
from tests import optimizer_runs
from tests.models import OddMLP, make_batches, micro_batches, reference_train


def config(kind: str, **params) -> OptimizerConfig:
    return OptimizerConfig.model_validate({"type": kind, "params": params})


def params(n=2, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]


def train(optimizer, tensors, grads, steps=3):
    for _ in range(steps):
        for p, g in zip(tensors, grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in tensors]


def test_adam_defaults_are_deepspeeds():
    opt = build_optimizer(params(), config("Adam"))
    assert type(opt) is torch.optim.AdamW  # 0.19.8: "Adam" means decoupled weight decay
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0, False)
    assert d["fused"] is True  # CPU float parameters: torch's fused kernel


def test_adam_with_adam_w_mode_false_is_classic_adam():
    opt = build_optimizer(params(), config("adam", adam_w_mode=False, weight_decay=0.1, lr=0.01))
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.1


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_decoupled_weight_decay_numerically(kind):
    # With zero gradients Adam's moments stay 0, so the only update is the decay itself:
    # decoupled (AdamW) shrinks p by lr * wd; L2 decay would instead move p by lr * sign(p).
    lr, wd = 0.1, 0.5
    ps = params()
    start = [p.detach().clone() for p in ps]
    after = train(build_optimizer(ps, config(kind, lr=lr, weight_decay=wd)), ps,
                  [torch.zeros_like(p) for p in ps], steps=1)
    for p0, p1 in zip(start, after):
        torch.testing.assert_close(p1, p0 * (1 - lr * wd))


def test_l2_weight_decay_numerically():
    lr, wd = 0.1, 0.5
    ps = params()
    start = [p.detach().clone() for p in ps]
    after = train(build_optimizer(ps, config("Adam", lr=lr, weight_decay=wd, adam_w_mode=False)), ps,
                  [torch.zeros_like(p) for p in ps], steps=1)
    for p0, p1 in zip(start, after):
        # The gradient becomes wd * p; Adam's first bias-corrected step is lr * sign(gradient).
        torch.testing.assert_close(p1, p0 - lr * torch.sign(p0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("adam_w_mode, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_adam_matches_torch_reference(adam_w_mode, reference):
    grads = [torch.randn(4, 3) for _ in range(2)]
    ps = params()
    ours = train(build_optimizer(ps, config("Adam", lr=0.05, weight_decay=0.1, betas=[0.8, 0.99],
                                            adam_w_mode=adam_w_mode)), ps, grads)
    ref_params = params()
    ref = train(reference(ref_params, lr=0.05, weight_decay=0.1, betas=(0.8, 0.99), foreach=False), ref_params, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_torch_adam_takes_torchs_weight_decay_default():
    assert build_optimizer(params(), config("AdamW", torch_adam=True)).defaults["weight_decay"] == 0.01
    assert build_optimizer(params(), config("AdamW")).defaults["weight_decay"] == 0.0


def test_fused_can_be_turned_off_and_amsgrad_on():
    opt = build_optimizer(params(), config("AdamW", fused=False, amsgrad=True))
    assert not opt.defaults["fused"] and opt.defaults["amsgrad"]


def test_sgd_matches_torch():
    cfg = config("sgd", lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)
    assert cfg.type == "SGD"
    grads = [torch.randn(4, 3) for _ in range(2)]
    opt = build_optimizer(params(), cfg)
    assert type(opt) is torch.optim.SGD and opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9
    ours = train(opt, opt.param_groups[0]["params"], grads)
    ref_params = params()
    ref = train(torch.optim.SGD(ref_params, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                ref_params, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_param_groups_keep_their_overrides_and_generators_work():
    a, b = params()
    opt = build_optimizer(({"params": iter([a]), "lr": 0.5}, {"params": b}), config("AdamW", lr=0.1))
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert build_optimizer((p for p in params()), config("SGD")).param_groups[0]["params"]


def test_auto_lr_is_never_a_silent_default():
    with pytest.raises(schemas.ConfigError, match="optimizer.params.lr: \"auto\" was not filled"):
        schemas.load_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


def test_zero_supported_optimizers_are_deepspeeds_torch_classes():
    # DeepSpeed's list (its FusedLion/CPU Lion and MuonWithAuxAdam are ops.Lion and ops.MuonWithAuxAdam
    # here) and ops.Lamb, whose trust ratio is per tensor under ZeRO (tests/test_optimizer_set.py)
    assert set(ZERO_SUPPORTED_OPTIMIZERS) == {torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                                              ops.UncorrectedAdam, ops.Adagrad, ops.Lion, ops.Lamb,
                                              ops.MuonWithAuxAdam}
    assert is_zero_supported_optimizer(build_optimizer(params(), config("Adam")))
    assert not is_zero_supported_optimizer(build_optimizer(params(), config("SGD")))


def test_resolve_optimizer_accepts_objects_callables_and_config():
    ps = params()
    own = torch.optim.SGD([{"params": ps}, {"params": []}], lr=0.1)
    assert resolve_optimizer(own, ps, config("Adam")) is own  # a passed optimizer wins over the config
    assert len(own.param_groups) == 1  # empty groups dropped, as DeepSpeed does
    made = resolve_optimizer(lambda p: torch.optim.Adam(p, lr=0.2), ps, None)
    assert type(made) is torch.optim.Adam and made.defaults["lr"] == 0.2
    assert type(resolve_optimizer(None, ps, config("AdamW"))) is torch.optim.AdamW
    assert resolve_optimizer(None, ps, None) is None


def test_config_optimizer_drops_empty_groups_before_the_schedule_counts_them():
    # tests/fuzz/param_groups_schedules.py seed 7: model_parameters with a {"params": []} group and a
    # per-group WarmupLR list, one value per group that has parameters (DeepSpeed drops the empty one
    # from the optimizer it built too); the config's optimizer kept it and initialize refused the list.
    from engine.schedules import resolve_scheduler
    from schemas.scheduler import SchedulerConfig
    ps = params(3)
    groups = [{"params": []}, {"params": ps[:2], "lr": 0.2}, {"params": [], "lr": 0.5}, {"params": ps[2:]}]
    opt = resolve_optimizer(None, groups, config("SGD", lr=0.1))
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.1]
    sched = resolve_scheduler(None, opt, SchedulerConfig.model_validate(
        {"type": "WarmupLR", "params": {"warmup_min_lr": [0.01, 0.02], "warmup_max_lr": [0.2, 0.4],
                                        "warmup_num_steps": 2, "warmup_type": "linear"}}))
    sched.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.105, 0.21])
    with pytest.raises(TypeError, match="not an optimizer"):
        resolve_optimizer(lambda p: 42, ps, None)


def errors(cfg: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        OptimizerConfig.model_validate(cfg)
    return {".".join(map(str, e["loc"])): e["msg"] for e in info.value.errors()}


def test_typo_in_params_names_the_key_and_suggests():
    found = errors({"type": "AdamW", "params": {"lr": 1e-3, "weight_decai": 0.1, "zzz": 1}})
    assert "did you mean 'weight_decay'?" in found["params.weight_decai"]
    assert "valid keys: lr, betas" in found["params.zzz"]


def test_sgd_params_are_not_adam_params():
    assert "params.betas" in errors({"type": "SGD", "params": {"betas": [0.9, 0.99]}})


def test_every_deepspeed_type_is_built():
    assert NOT_BUILT_OPTIMIZERS == []  # mup's three: tests/test_mup_optimizers.py


def test_mup_types_take_their_torch_classes_params():
    assert OptimizerConfig.model_validate({"type": "muadamw", "params": {"lr": 0.1}}).type == "MuAdamW"
    assert "params.momentum" in errors({"type": "MuAdam", "params": {"momentum": 0.9}})
    assert "params.betas" in errors({"type": "musgd", "params": {"betas": [0.9, 0.99]}})


def test_unknown_type_lists_valid_names():
    msg = errors({"type": "AdamX"})["type"]
    assert "did you mean 'Adam" in msg and "Adam, AdamW, SGD" in msg
    assert OptimizerConfig.model_validate({"type": "rmsprop"}).type == "RMSprop"  # torch.optim by name


@pytest.mark.parametrize("params, key, text", [
    ({"bias_correction": False, "fused": True}, "params.fused", "fused kernel always corrects the bias"),
    ({"max_grad_norm": 1.0}, "params.max_grad_norm", "gradient_clipping"),
    ({"betas": [0.9, 1.5]}, "params.betas", "[0, 1)"),
    ({"lr": -1}, "params.lr", "greater than or equal to 0"),
    ({"lr": "0.1"}, "params.lr", "valid number"),
])
def test_bad_adam_params_are_rejected(params, key, text):
    assert text in errors({"type": "Adam", "params": params})[key]


def test_adamw_with_adam_w_mode_false_is_a_contradiction():
    assert "contradicts" in errors({"type": "AdamW", "params": {"adam_w_mode": False}})["params.adam_w_mode"]


def test_nesterov_needs_momentum():
    assert "params.nesterov" in errors({"type": "SGD", "params": {"nesterov": True}})


def reference_uncorrected_adam(param: torch.Tensor, grads: list, lr, betas, eps, wd, decoupled, amsgrad=False):
    """DeepSpeed's FusedAdam(bias_correction=False) written out element-wise in float64, step by step."""
    x = param.detach().double().clone()
    m, v, vmax = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    for g in grads:
        g = g.double() + (0.0 if decoupled else wd * x)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        vmax = torch.maximum(vmax, v)
        update = m / ((vmax if amsgrad else v).sqrt() + eps) + (wd * x if decoupled else 0.0)
        x = x - lr * update
    return x


@pytest.mark.parametrize("kind,extra,decoupled", [
    ("AdamW", {}, True), ("Adam", {"adam_w_mode": False}, False), ("Adam", {}, True),
    ("AdamW", {"amsgrad": True}, True)])
def test_bias_correction_false_is_fused_adams_update_without_the_correction(kind, extra, decoupled):
    p = torch.nn.Parameter(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)))
    grads = [torch.randn(3, 5, generator=torch.Generator().manual_seed(10 + i)) for i in range(6)]
    hyper = {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    opt = build_optimizer([p], config(kind, bias_correction=False, **hyper, **extra))
    assert type(opt) is ops.UncorrectedAdam and is_zero_supported_optimizer(opt)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = reference_uncorrected_adam(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), grads,
                                          hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"], decoupled,
                                          amsgrad=extra.get("amsgrad", False))
    torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
    assert opt.state[p]["step"] == len(grads)


def test_bias_correction_false_differs_from_torchs_adam_and_refuses_the_fused_kernel():
    p, q = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    ours, torchs = build_optimizer([p], config("AdamW", bias_correction=False)), build_optimizer([q], config("AdamW"))
    p.grad, q.grad = torch.full((4,), 0.5), torch.full((4,), 0.5)
    ours.step(), torchs.step()
    # first step: lr·(1−β1)g / (√((1−β2)g²) + ε) = lr·0.1/√0.001 ≈ 3.16·lr, where Adam moves lr
    torch.testing.assert_close(1 - p.detach(), torch.full((4,), 1e-3 * 0.1 / 0.001 ** 0.5), rtol=1e-4, atol=0)
    torch.testing.assert_close(1 - q.detach(), torch.full((4,), 1e-3), rtol=1e-4, atol=0)
    with pytest.raises(ValidationError, match="fused kernel always corrects the bias"):
        config("AdamW", bias_correction=False, fused=True)
    with pytest.raises(ValidationError, match="torch's Adam always corrects the bias"):
        config("AdamW", bias_correction=False, torch_adam=True)


def _train_uncorrected_zero2():
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    eng, opt, _, _ = engine.initialize(model=OddMLP(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": False}}})
    for x, y in make_batches(5, 2 * world):
        for xm, ym in micro_batches(x, y, rank, world, 1):
            eng.backward(eng(xm, ym))
            eng.step()
    return type(eng.zero_optimizer.optimizer).__name__, {k: v.clone() for k, v in eng.module.state_dict().items()}


def test_bias_correction_false_under_zero_stage_2_is_single_process_training():
    results = optimizer_runs.part(2, "uncorrected_zero2")  # in the optimizer tests' shared 2-rank spawn
    torch.manual_seed(0)
    ref, _, _ = reference_train(OddMLP(), make_batches(5, 4),
                                lambda ps: ops.UncorrectedAdam(ps, lr=1e-2, weight_decay=0.1))
    for kind, state in results:
        assert kind == "UncorrectedAdam"
        for k, v in state.items():
            torch.testing.assert_close(v, ref.state_dict()[k], atol=1e-6, rtol=1e-5)


def test_muon_ns_dtype_bf16_reaches_the_optimizer_and_orthogonalises_in_bf16():
    """`optimizer.params.ns_dtype: "bf16"` (dstrain's key, for accelerators with bf16 matmuls): the built
    optimizer runs Newton-Schulz in bf16, whose result is fp32 and within bf16 rounding of the fp32 one."""
    from ops.muon import newton_schulz
    ps = params()
    for p in ps:
        p.use_muon = True
    assert build_optimizer(ps, config("Muon")).ns_dtype is torch.float32
    opt = build_optimizer(ps, config("Muon", ns_dtype="bf16"))
    assert opt.ns_dtype is torch.bfloat16
    torch.manual_seed(1)
    m = torch.randn(24, 16)
    fp32, bf16 = newton_schulz(m), newton_schulz(m, torch.bfloat16)
    assert bf16.dtype is torch.float32 and not torch.equal(bf16, fp32)  # computed in bf16, not in fp32
    assert torch.linalg.vector_norm(bf16 - fp32) <= 0.05 * torch.linalg.vector_norm(fp32)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, ps))
    with pytest.raises(Exception, match="ns_dtype"):
        config("Muon", ns_dtype="fp16")
