"""fp16 loss scaling follows DeepSpeed's DynamicLossScaler rules, step by step."""
from __future__ import annotations

import pytest

from engine.precision import LossScaleAtMinimum, LossScaler, NonFiniteGuard


def _trajectory(scaler: LossScaler, overflows: str) -> list[float]:
    """Scale after each update; `overflows` is a string of 'o' (overflow) and '.' (clean)."""
    out = []
    for flag in overflows:
        scaler.update(flag == "o")
        out.append(scaler.loss_scale)
    return out


def test_dynamic_scale_with_hysteresis_window_and_minimum():
    # Worked by hand from DeepSpeed's rules: init 2**4, window 3, hysteresis 2, min 2.
    # iter 2: 3 clean steps since "iteration -1" → double. iter 3: first overflow spends hysteresis.
    # iter 4, 5: budget is 1 → halve (not refilled by overflows). iter 8: 3 clean since 5 → double.
    scaler = LossScaler(16, dynamic=True, scale_window=3, hysteresis=2, min_scale=2)
    assert _trajectory(scaler, "...ooo...oooo") == [16, 16, 32, 32, 16, 8, 8, 8, 16, 16, 8, 4, 2]
    with pytest.raises(LossScaleAtMinimum, match="min_loss_scale=2"):
        scaler.update(True)


def test_consecutive_hysteresis_refills_budget_on_every_clean_step():
    scaler = LossScaler(16, dynamic=True, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    # o: budget 2→1; '.': refilled to 2; o: →1; o: halve (16→8); '.': refill; o: →1 (no halving)
    assert _trajectory(scaler, "o.oo.o") == [16, 16, 16, 8, 8, 8]


def test_hysteresis_one_halves_at_once_and_window_counts_from_last_overflow():
    scaler = LossScaler(8, dynamic=True, scale_window=2, hysteresis=1, min_scale=1)
    # o: 4 (iter 0); clean iter 1: (1-0)%2=1 no; iter 2: 2%2=0 → 8; iter 3: 3%2 no; iter 4 → 16
    assert _trajectory(scaler, "o....") == [4, 4, 8, 8, 16]


def test_static_scale_never_changes():
    scaler = LossScaler(128, dynamic=False)
    assert _trajectory(scaler, "oo..o") == [128] * 5


def test_from_config_defaults_match_deepspeed():
    import schemas
    cfg = schemas.load_config({"train_batch_size": 1, "fp16": {"enabled": True}})
    s = LossScaler.from_config(cfg.fp16)
    assert (s.loss_scale, s.dynamic, s.scale_window, s.delayed_shift, s.min_scale) == (2.0 ** 16, True, 1000, 2, 1.0)
    static = LossScaler.from_config(schemas.load_config({"train_batch_size": 1, "fp16": {"enabled": True,
                                                                                       "loss_scale": 64}}).fp16)
    assert (static.loss_scale, static.dynamic) == (64.0, False)


def test_guard_policy_for_bf16_and_fp32():
    guard = NonFiniteGuard(LossScaler(), "bf16", nan_policy="skip", max_consecutive_skips=2)
    assert guard.check(1.0, 1) is True
    assert guard.check(float("nan"), 2) is False
    assert guard.check(3.0, 3) is True and guard.consecutive_skips == 0
    assert guard.check(float("inf"), 4) is False
    with pytest.raises(FloatingPointError, match="step 5: 2 consecutive"):
        guard.check(float("nan"), 5)
    strict = NonFiniteGuard(LossScaler(), "fp32", nan_policy="raise")
    with pytest.raises(FloatingPointError, match="step 7: non-finite"):
        strict.check(float("inf"), 7)
    # Round trip of the state checkpoints will save.
    copy = NonFiniteGuard(LossScaler(), "bf16")
    copy.load_state_dict(guard.state_dict())
    assert copy.state_dict() == guard.state_dict()
