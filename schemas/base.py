"""The base every config section derives from: strict, frozen, DeepSpeed-compatible.

[Note: strictness] DeepSpeed silently ignores unknown keys in half of its sections (issues #653, #774,
#1809). Here every section forbids extra keys, so a typo is an error that names its full path. Values
are validated in pydantic's strict mode, so `"enabled": "false"` or `"stage": true` are errors instead
of being coerced to something the user did not mean. Two relaxations, both for files people publish:
an integral float (`5e8`, `1e5`) is accepted wherever an int is expected and becomes that int
(DeepSpeed reads `steps_per_print` untyped and its size fields as `pp_int`), but `2.5` is not; and keys
whose name starts with `_comment` are comments (DeepSpeed ignores them) at any depth.
[Note: "auto"] "auto" is a value a host program (HF Trainer/Accelerate) fills in before the engine
sees it; `schemas/auto.py` deals with it before these models run, so a section never sees "auto"
except where it has a meaning of its own (`zero_optimization.overlap_comm`, `pipeline.stages`).
[Note: docstrings] Each field's attribute docstring is its entry in the config reference
(`use_attribute_docstrings`), reachable as `Model.model_fields[name].description`.
"""
from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

COMMENT_PREFIX = "_comment"


def is_comment_key(key: Any) -> bool:
    """True for a `_comment...` key, which a config may carry anywhere as a note to its reader."""
    return isinstance(key, str) and key.startswith(COMMENT_PREFIX)


def _takes_int_not_float(annotation: Any) -> bool:
    """True when `annotation` admits an int but no float (so an integral float can only mean the int)."""
    found: set = set()

    def collect(a: Any) -> None:
        if a in (int, float):
            found.add(a)
        for arg in typing.get_args(a):
            collect(arg)
    collect(annotation)
    return found == {int}


def _integral_float_to_int(value: Any) -> Any:
    # 5e8 parses as a float in JSON; DeepSpeed's pp_int fields accept it, so do we (but not 2.5).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class StrictModel(BaseModel):
    """A config section: unknown keys rejected, values frozen after loading."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        populate_by_name=True,
        validate_default=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,  # JSON's NaN/Infinity extensions are never a meaningful setting
    )

    @model_validator(mode="before")
    @classmethod
    def _comments_and_integral_floats(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {}
        for key, value in data.items():
            if is_comment_key(key):
                continue
            field = cls.model_fields.get(key) or next(
                (f for f in cls.model_fields.values() if f.alias == key), None)
            if field is not None and _takes_int_not_float(field.annotation):
                value = _integral_float_to_int(value)
            out[key] = value
        return out


Size = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An element count or byte size: an int, or a float with no fractional part such as 5e8."""
