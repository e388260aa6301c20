"""fp16 / bf16 training with fp32 master weights, and the NaN/Inf policy, at ZeRO stage 0.

Tolerances: fp16 keeps 11 significant bits (relative rounding 2**-11 ≈ 5e-4 per op), bf16 keeps 8
(2**-8 ≈ 4e-3). Over 20 Adam steps of a small GPT the per-step loss of a low-precision run stays
within 1% (fp16) / 3% (bf16) of the fp32 run's: a few ulps of each dtype, accumulated over the
forward pass, with no drift because the master weights are fp32.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import engine
import schemas
from examples.gpt import GPT, ByteCorpus, GPTConfig
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

SMALL_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
STEPS = 20


def _gpt_config(precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": 20000}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "bf16-fp32acc":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _train_gpt(precision: str):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    eng, opt, _, _ = engine.initialize(model=GPT(SMALL_GPT), config=_gpt_config(precision))
    data = ByteCorpus(seq_len=SMALL_GPT.seq_len, max_bytes=200_000)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for k in range(2):
            i = ((step * 2 + k) * world + rank) * 4
            x, y = (torch.stack(t) for t in zip(*[data[j] for j in range(i, i + 4)]))
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            step_losses.append(loss.float().item())
        losses.append(sum(step_losses) / 2)
    master_dtypes = {p.dtype for g in opt.param_groups for p in g["params"]}
    state_dtypes = {t.dtype for s in opt.state.values() for t in s.values() if t.dim() > 0}
    model_dtypes = {p.dtype for p in eng.module.parameters()}
    return {"losses": losses, "master": master_dtypes, "state": state_dtypes, "model": model_dtypes,
            "skipped": eng.skipped_steps, "grad_dtypes": {b.dtype for b in eng.zero_optimizer.buckets.flat.values()}}


def _train_all_precisions():
    return {p: _train_gpt(p) for p in ("fp32", "fp16", "bf16", "bf16-fp32acc")}


@pytest.fixture(scope="module")
def precision_runs():
    return run_distributed(_train_all_precisions, 2, timeout=180)[0]


@pytest.mark.parametrize("precision,tol,model_dtype", [("fp16", 0.01, torch.float16),
                                                       ("bf16", 0.03, torch.bfloat16),
                                                       ("bf16-fp32acc", 0.03, torch.bfloat16)])
def test_low_precision_tracks_fp32(precision_runs, precision, tol, model_dtype):
    ref, run = precision_runs["fp32"], precision_runs[precision]
    assert run["model"] == {model_dtype}
    assert run["master"] == {torch.float32} and run["state"] == {torch.float32}
    assert run["skipped"] == 0
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        assert abs(a - b) <= tol * b, f"step {step}: {precision} loss {a:.4f} vs fp32 {b:.4f}"
    assert run["losses"][-1] < run["losses"][0] - 1.0  # it actually trained


def test_bf16_gradients_accumulate_in_fp32_when_asked(precision_runs):
    assert precision_runs["bf16"]["grad_dtypes"] == {torch.bfloat16}
    assert precision_runs["bf16-fp32acc"]["grad_dtypes"] == {torch.float32}


# -- an Inf/NaN gradient on one rank only -----------------------------------------------------------
BAD_STEP = 2


def _mlp_config(precision: str, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 500}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def _train_with_poison(precision: str, poison: bool, skip_bad_batch: bool):
    """Train 5 steps; at BAD_STEP rank 1 feeds an Inf (poison) or the batch is left out (skip_bad_batch)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    eng, _, _, sched = engine.initialize(model=OddMLP(), config=_mlp_config(precision))
    record = []
    for step, (x, y) in enumerate(make_batches(5, 2 * world)):
        if step == BAD_STEP and skip_bad_batch:
            continue
        xm, ym = next(micro_batches(x, y, rank, world, 1))
        if step == BAD_STEP and poison and rank == 1:
            xm = xm.clone()
            xm[0, 0] = float("inf")
        dtype = eng.module.l1.weight.dtype
        before = [p.detach().clone() for p in eng.module.parameters()]
        eng.backward(eng(xm.to(dtype), ym.to(dtype)))
        eng.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, eng.module.parameters()))
        record.append({"applied": eng.was_step_applied(), "unchanged": unchanged, "lr": eng.get_lr()[0],
                       "scale": eng.zero_optimizer.guard.scaler.loss_scale})
    return {"record": record, "skipped": eng.skipped_steps, "global_steps": eng.global_steps,
            "params": {k: v.float().clone() for k, v in eng.module.state_dict().items()},
            "sched_steps": sched.last_batch_iteration}


def _poison_runs():
    return {"fp32-poison": _train_with_poison("fp32", True, False),
            "fp32-clean": _train_with_poison("fp32", False, True),
            "fp16-poison": _train_with_poison("fp16", True, False),
            "bf16-poison": _train_with_poison("bf16", True, False)}


@pytest.fixture(scope="module")
def poison_runs():
    return run_distributed(_poison_runs, 2, timeout=120)


@pytest.mark.parametrize("name", ["fp32-poison", "fp16-poison", "bf16-poison"])
def test_inf_on_one_rank_skips_the_same_step_everywhere(poison_runs, name):
    for rank_result in poison_runs:
        run = rank_result[name]
        bad = run["record"][BAD_STEP]
        assert bad["applied"] is False and bad["unchanged"] is True
        assert [r["applied"] for r in run["record"]] == [True, True, False, True, True]
        assert run["skipped"] == 1 and run["global_steps"] == 5
        assert run["record"][BAD_STEP]["lr"] == run["record"][BAD_STEP - 1]["lr"]  # schedule held
        assert run["sched_steps"] == 3  # 4 applied steps; last_batch_iteration starts at -1
    for key in poison_runs[0][name]["params"]:
        assert torch.equal(poison_runs[0][name]["params"][key], poison_runs[1][name]["params"][key])


def test_fp16_overflow_halves_the_scale(poison_runs):
    scales = [r["scale"] for r in poison_runs[0]["fp16-poison"]["record"]]
    assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2


def test_skipped_step_equals_leaving_the_batch_out(poison_runs):
    poisoned, clean = poison_runs[0]["fp32-poison"], poison_runs[0]["fp32-clean"]
    for key, value in clean["params"].items():
        torch.testing.assert_close(poisoned["params"][key], value, rtol=0, atol=0)


# -- policies that stop the run -----------------------------------------------------------------------
def _raise_policy():
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_mlp_config(
        "fp32", fault_tolerance={"nan_policy": "raise"}))
    x, y = make_batches(1, 2)[0]
    x[0, 0] = float("nan")
    try:
        eng.backward(eng(x, y))
        eng.step()
    except FloatingPointError as e:
        return str(e)
    return None


def test_nan_policy_raise_names_the_step():
    message = run_distributed(_raise_policy, 1)[0]
    assert message is not None and message.startswith("step 1: non-finite gradient norm")


def _fp16_state_round_trip():
    torch.manual_seed(0)
    batches = make_batches(6, 2)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_mlp_config("fp16"))
    for x, y in batches[:3]:
        eng.backward(eng(x.half(), y.half()))
        eng.step()
    buffer = io.BytesIO()  # through bytes, as a checkpoint would: no tensor shared between engines
    torch.save(eng.training_state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    other, _, _, _ = engine.initialize(model=OddMLP(), config=_mlp_config("fp16"))
    other.load_training_state_dict(state)
    for e in (eng, other):
        for x, y in batches[3:]:
            e.backward(e(x.half(), y.half()))
            e.step()
    same = all(torch.equal(a, b) for a, b in zip(eng.module.parameters(), other.module.parameters()))
    return same, other.zero_optimizer.guard.scaler.state_dict() == eng.zero_optimizer.guard.scaler.state_dict()


def test_precision_state_round_trips_through_state_dict():
    same_params, same_scaler = run_distributed(_fp16_state_round_trip, 1)[0]
    assert same_params and same_scaler


@pytest.mark.parametrize("bad,fragment", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16"),
    ({"fp16": {"enabled": True, "loss_scale_window": -1}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 64}}, "min_loss_scale"),
    ({"fault_tolerance": {"nan_policy": "ignore"}}, "fault_tolerance.nan_policy"),
])
def test_bad_precision_configs(bad, fragment):
    with pytest.raises(schemas.ConfigError, match=fragment.replace(".", r"\.")):
        schemas.load_config({"train_batch_size": 2, **bad})


@contextlib.contextmanager
def _onednn_off():
    """The scalar fallback, as on a CPU without AVX512-FP16 (only `enabled`: mkldnn.flags() also sets
    oneDNN's TF32 switch, which warns on a CPU build)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def test_fp16_on_a_cpu_without_onednn_fp16_warns():
    from engine.precision import slow_cpu_fp16_warning
    fp16, bf16 = (schemas.load_config({"train_batch_size": 2, p: {"enabled": True}}) for p in ("fp16", "bf16"))
    cpu = torch.device("cpu")
    with _onednn_off():
        assert "fp16.enabled" in slow_cpu_fp16_warning(fp16, cpu)
        assert slow_cpu_fp16_warning(bf16, cpu) is None
        assert slow_cpu_fp16_warning(fp16, torch.device("cuda", 0)) is None
    fast_here = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert (slow_cpu_fp16_warning(fp16, cpu) is None) == fast_here


def _initialize_fp16_without_onednn():
    import warnings
    with _onednn_off(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.initialize(model=OddMLP(), config=_mlp_config("fp16"))
    return [str(w.message) for w in caught if "fp16.enabled" in str(w.message)]


def test_initialize_says_once_what_fp16_costs_on_such_a_cpu():
    assert len(run_distributed(_initialize_fp16_without_onednn, 1)[0]) == 1
