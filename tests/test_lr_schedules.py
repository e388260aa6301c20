"""LR schedules: each one's lr sequence equals DeepSpeed's formula, written here independently from
the reference table (shared/reference/deepspeed.md §1.4); resume; bad params.

Sequence convention (DeepSpeed's): element 0 is the lr written at construction, element k (k >= 1) the
lr after the k-th `step()`, i.e. at t = k - 1.
"""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from engine.schedules import LRSchedule, build_scheduler, resolve_scheduler
from schemas.scheduler import SchedulerConfig

STEPS = 30


def make_optimizer(lr=0.5, kind="adam", groups=1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    param_groups = [{"params": [p]} for p in params]
    if kind == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, momentum=0.9)
    return torch.optim.AdamW(param_groups, lr=lr)


def run(cfg: dict, optimizer=None, steps=STEPS):
    optimizer = optimizer or make_optimizer()
    schedule = build_scheduler(optimizer, SchedulerConfig.model_validate(cfg))
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        assert schedule.get_last_lr()[0] == lrs[-1]
    return lrs, schedule, optimizer


def warmup_gamma(t, n, kind):
    n = max(n, 2)
    return math.log(t + 1) / math.log(n) if kind == "log" else t / n


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_follows_formula(kind):
    lo, hi, n = 0.01, 0.1, 10
    lrs, _, _ = run({"type": "WarmupLR", "params": {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                                    "warmup_num_steps": n, "warmup_type": kind}})
    expected = [lo] + [lo + (hi - lo) * (warmup_gamma(t, n, kind) if t < n else 1.0) for t in range(STEPS)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_lr_defaults_to_optimizer_lr_and_clamps_steps_to_two():
    lrs, _, _ = run({"type": "warmuplr", "params": {"warmup_num_steps": 1}}, make_optimizer(lr=0.3))
    # N = max(2, 1) = 2: log warmup gives 0 at t=0, ln2/ln2 = 1 at t=1, then the optimizer's own lr.
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.3, 0.3])


def test_warmup_decay_lr_follows_formula():
    lo, hi, n, total = 0.0, 0.2, 5, 25
    lrs, _, _ = run({"type": "WarmupDecayLR", "params": {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                                         "warmup_num_steps": n, "total_num_steps": total,
                                                         "warmup_type": "linear"}})

    def gamma(t):
        return t / n if t < n else max(0.0, (total - t) / max(1, total - n))

    assert lrs == pytest.approx([lo] + [lo + (hi - lo) * gamma(t) for t in range(STEPS)])
    assert lrs[-1] == 0.0  # past total_num_steps the lr stays at warmup_min_lr


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_scales_the_optimizer_lr(kind):
    base, n, total, wmr, cmr = 0.5, 5, 20, 0.1, 0.01
    lrs, _, _ = run({"type": "WarmupCosineLR", "params": {
        "total_num_steps": total, "warmup_num_steps": n, "warmup_min_ratio": wmr, "cos_min_ratio": cmr,
        "warmup_type": kind}}, make_optimizer(lr=base))

    def ratio(t):
        if t < n:
            return wmr + (1 - wmr) * warmup_gamma(t, n, kind)
        progress = min(1.0, (t - n + 1) / max(1, total - n))
        return max(0.0, cmr + (1 - cmr) * (1 + math.cos(math.pi * progress)) / 2)

    assert lrs == pytest.approx([0.0] + [base * ratio(t) for t in range(STEPS)])
    assert lrs[-1] == pytest.approx(base * cmr)  # held at the floor past total_num_steps


def one_cycle_scale(t, s1, s2, n1=0, n2=0):
    pos = (t + 1) % (s1 + s2)
    if pos <= s1:
        return math.floor(pos * n1 / s1) / n1 if n1 else pos / s1
    return math.floor((s1 + s2 - pos) * n2 / s2) / n2 if n2 else (s1 + s2 - pos) / s2


def test_one_cycle_cycles_lr_and_beta1_then_decays():
    lo, hi, s1, s2, rate, dss = 0.01, 0.1, 6, 4, 0.5, 2
    mlo, mhi, mrate = 0.85, 0.95, 0.1
    lrs, schedule, opt = run({"type": "OneCycle", "params": {
        "cycle_min_lr": lo, "cycle_max_lr": hi, "cycle_first_step_size": s1, "cycle_second_step_size": s2,
        "decay_lr_rate": rate, "decay_step_size": dss, "cycle_min_mom": mlo, "cycle_max_mom": mhi,
        "decay_mom_rate": mrate}}, steps=0)
    assert lrs == [lo] and opt.param_groups[0]["betas"] == (mlo, 0.99)
    for t in range(STEPS):
        schedule.step()
        if t < s1 + s2:
            scale = one_cycle_scale(t, s1, s2)
            lr, beta1 = lo + (hi - lo) * scale, mhi - (mhi - mlo) * scale
        else:
            d = t - (s1 + s2) + 1
            lr, beta1 = lo / (1 + rate * d / dss), mhi * (1 + mrate * d / dss)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr), t
        assert opt.param_groups[0]["betas"] == pytest.approx((beta1, 0.99)), t


def test_one_cycle_staircase():
    lo, hi, s1, s2, n1, n2 = 0.0, 1.0, 6, 4, 3, 2
    lrs, _, _ = run({"type": "OneCycle", "params": {
        "cycle_min_lr": lo, "cycle_max_lr": hi, "cycle_first_step_size": s1, "cycle_second_step_size": s2,
        "cycle_first_stair_count": n1, "cycle_second_stair_count": n2}}, steps=s1 + s2 - 1)
    assert lrs == pytest.approx([lo] + [one_cycle_scale(t, s1, s2, n1, n2) for t in range(s1 + s2 - 1)])
    assert max(lrs) == 1.0  # the peak is reached, not lost to a float a hair below the top stair


def test_one_cycle_leaves_sgd_momentum_alone():
    opt = make_optimizer(kind="sgd")
    _, schedule, _ = run({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}, opt, 3)
    assert "betas" not in opt.param_groups[0] and schedule.get_mom() is None


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_follows_formula(staircase):
    lo, size, rate = 0.01, 5, 0.5
    lrs, _, _ = run({"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": lo, "lr_range_test_step_size": size, "lr_range_test_step_rate": rate,
        "lr_range_test_staircase": staircase}})

    def interval(t):
        return math.floor((t + 1) / size) if staircase else (t + 1) / size

    assert lrs == pytest.approx([lo] + [lo * (1 + rate * interval(t)) for t in range(STEPS)])


RESUMABLE = [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 8}},
    {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 8, "total_num_steps": 20}},
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 8, "total_num_steps": 20}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                                    "decay_step_size": 3, "decay_lr_rate": 0.2}},
    {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 4}},
]


@pytest.mark.parametrize("cfg", RESUMABLE, ids=[c["type"] for c in RESUMABLE])
def test_state_dict_round_trip_resumes_the_sequence(cfg):
    full, _, _ = run(cfg)
    _, first, _ = run(cfg, steps=12)
    state = first.state_dict()
    assert state["last_batch_iteration"] == 11
    opt = make_optimizer()
    resumed = build_scheduler(opt, SchedulerConfig.model_validate(cfg))
    resumed.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == pytest.approx(full[12])
    rest = []
    for _ in range(STEPS - 12):
        resumed.step()
        rest.append(opt.param_groups[0]["lr"])
    assert rest == pytest.approx(full[13:])


def test_explicit_iteration_and_per_group_values():
    opt = make_optimizer(groups=2)
    schedule = build_scheduler(opt, SchedulerConfig.model_validate({"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": [0.1, 0.2], "lr_range_test_step_size": 1}}))
    schedule.step(4)  # jump: t = 4, interval 5
    assert schedule.get_last_lr() == pytest.approx([0.6, 1.2])
    assert schedule.get_lr() == schedule.get_last_lr()


def test_tensor_lr_stays_a_tensor():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01))
    build_scheduler(opt, SchedulerConfig.model_validate({"type": "LRRangeTest"})).step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3 * (1 + 1 / 2000))


def test_per_group_list_must_match_param_groups():
    cfg = SchedulerConfig.model_validate({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2, 0.3]}})
    with pytest.raises(ValueError, match="3 values but the optimizer has 2 param groups"):
        build_scheduler(make_optimizer(groups=2), cfg)


def test_per_group_lists_dump_without_serializer_warnings():
    # tests/fuzz/param_groups_schedules.py seed 40: every save_checkpoint writes Config.to_dict() into its
    # metadata, and a per-group list made pydantic warn there (an error under -W error::UserWarning).
    import warnings
    import schemas
    source = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": [0.1, 0.2], "total_num_steps": 5}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dumped = schemas.load_config(source, world_size=1).to_dict()
    assert dumped["scheduler"]["params"]["warmup_min_lr"] == [0.1, 0.2]
    assert schemas.load_config(dumped, world_size=1).scheduler.params.warmup_min_lr == (0.1, 0.2)


def errors(cfg: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        SchedulerConfig.model_validate(cfg)
    return {".".join(map(str, e["loc"])): e["msg"] for e in info.value.errors()}


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_num_steps_is_required(kind):
    assert "params.total_num_steps" in errors({"type": kind, "params": {}})


@pytest.mark.parametrize("params, key", [
    ({"warmup_type": "cosine"}, "params.warmup_type"),
    ({"warmup_num_steps": 0}, "params.warmup_num_steps"),
    ({"warmup_min_lr": -0.1}, "params.warmup_min_lr"),
    ({"warmup_max_lr": "high"}, "params.warmup_max_lr"),
    ({"warmup_num_steps": 2.5}, "params.warmup_num_steps"),
])
def test_bad_warmup_values_are_rejected(params, key):
    assert key in errors({"type": "WarmupLR", "params": params})


def test_one_cycle_needs_its_bounds_and_positive_step_size():
    found = errors({"type": "OneCycle", "params": {"cycle_first_step_size": 0}})
    assert {"params.cycle_min_lr", "params.cycle_max_lr", "params.cycle_first_step_size"} <= set(found)


def test_cosine_ratios_are_ratios():
    assert "params.cos_min_ratio" in errors({"type": "WarmupCosineLR",
                                             "params": {"total_num_steps": 10, "cos_min_ratio": 1.5}})


def test_typo_in_params_names_the_key_and_suggests():
    found = errors({"type": "WarmupLR", "params": {"warmup_num_step": 10}})
    assert "did you mean 'warmup_num_steps'" in found["params.warmup_num_step"]


def test_unknown_type_lists_valid_types():
    found = errors({"type": "WarmupCosLR"})
    assert "did you mean 'WarmupCosineLR'" in found["type"] and "LRRangeTest" in found["type"]
    assert "initialize(lr_scheduler=...)" in errors({"type": "StepLR"})["type"]


def test_type_is_canonical_and_defaults_apply():
    cfg = SchedulerConfig.model_validate({"type": "onecycle", "params": {
        "cycle_min_lr": 0.1, "cycle_max_lr": 1}})
    assert cfg.type == "OneCycle" and cfg.params.cycle_first_step_size == 2000
    assert cfg.params.decay_lr_rate == 0.0
    assert SchedulerConfig.model_validate({"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10}}).params.warmup_max_lr == 1e-3


def test_resolve_scheduler_accepts_objects_callables_and_config():
    opt = make_optimizer()
    cfg = SchedulerConfig.model_validate({"type": "LRRangeTest"})
    assert isinstance(resolve_scheduler(None, opt, cfg), LRSchedule)
    assert resolve_scheduler(None, opt, None) is None
    own = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert resolve_scheduler(own, opt, cfg) is own
    made = resolve_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1), opt, None)
    assert isinstance(made, torch.optim.lr_scheduler.StepLR) and made.optimizer is opt
    with pytest.raises(ValueError, match="no optimizer"):
        resolve_scheduler(None, None, cfg)
