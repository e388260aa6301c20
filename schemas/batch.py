"""Batch-size arithmetic: train_batch_size = micro × gradient_accumulation_steps × world_size.

Which keys are derived from which follows DeepSpeed's `_set_batch_related_parameters` (reference
§1.2). DeepSpeed floor-divides first and then reports a confusing mismatch; here a value that does
not divide exactly is reported as such, naming the given keys, the derived ones and the world size.
"auto" (as written in HF templates) is a value a host program fills: it is derived when the two other
keys are given (the product then fixes it), and otherwise an error that names the "auto" keys and
how to supply them (`schemas/auto.py`), never a default such as gradient_accumulation_steps 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from schemas.auto import unfilled_line
from schemas.errors import show_value

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The three resolved batch keys."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def given_batch_keys(raw: dict) -> tuple[dict[str, Any], list[str]]:
    """The batch keys the user gave (absent, null and "auto" left out), and problems with their values."""
    given, problems = {}, []
    for key in (TBS, MICRO, GAS):
        value = raw.get(key)
        if value is None or value == "auto":
            continue
        if isinstance(value, float) and value.is_integer():  # 1e3, as for every int field
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key}: {show_value(value)} is not valid: expected a positive integer or \"auto\"")
        else:
            given[key] = value
    return given, problems


def _context(given: dict[str, int], derived: list[str], world_size: int) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    return f"(given: {shown}; derived: {', '.join(derived) or 'nothing'}; world_size={world_size})"


def _divide(given: dict[str, int], world_size: int, divisor_key: Optional[str], derived: list[str]):
    """train_batch_size // (given[divisor_key] × world_size), or a problem line if it is not exact."""
    tbs = given[TBS]
    factor = (given[divisor_key] if divisor_key else 1) * world_size
    if tbs % factor == 0:
        return tbs // factor, None
    by = f"{divisor_key} {given[divisor_key]} × world_size {world_size}" if divisor_key else f"world_size {world_size}"
    return None, (f"{TBS}: {tbs} is not divisible by {by} = {factor}, so {' and '.join(derived)} "
                  f"cannot be derived {_context(given, derived, world_size)}")


def derive_batch_sizes(given: dict[str, int], world_size: int,
                       auto: tuple[str, ...] = ()) -> tuple[Optional[BatchSizes], list[str]]:
    """Derive the missing batch keys from the given ones (DeepSpeed's table), checking exactness.
    `auto`: the batch keys written as "auto", named when the rest cannot derive them."""
    tbs, micro, gas = given.get(TBS), given.get(MICRO), given.get(GAS)
    if auto and len(given) < 2:
        # Deriving would need a default (gradient_accumulation_steps 1, say) for a value the host
        # program was meant to fill; only the arithmetic of two given keys may stand in for it.
        return None, [unfilled_line(key) for key in (TBS, MICRO, GAS) if key in auto]
    if tbs is None and micro is None:
        alone = f" ({GAS} alone is not enough)" if gas is not None else ""
        return None, [f"{TBS}: neither {TBS} nor {MICRO} is given{alone}; give at least one of them"]
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world_size:
            return None, [f"{TBS}: {tbs} != {MICRO} {micro} × {GAS} {gas} × world_size {world_size} "
                          f"= {micro * gas * world_size} {_context(given, [], world_size)}"]
        return BatchSizes(tbs, micro, gas), []
    if tbs is None:  # micro given, maybe gas
        gas = gas if gas is not None else 1
        return BatchSizes(micro * gas * world_size, micro, gas), []
    if micro is not None:
        gas, problem = _divide(given, world_size, MICRO, [GAS])
        return (BatchSizes(tbs, micro, gas), []) if problem is None else (None, [problem])
    if gas is not None:
        micro, problem = _divide(given, world_size, GAS, [MICRO])
        return (BatchSizes(tbs, micro, gas), []) if problem is None else (None, [problem])
    micro, problem = _divide(given, world_size, None, [MICRO, GAS])
    return (BatchSizes(tbs, micro, 1), []) if problem is None else (None, [problem])
