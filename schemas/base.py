"""The base every config section derives from: strict, frozen, DeepSpeed-compatible.

[Note: strictness] DeepSpeed silently ignores unknown keys in half of its sections (issues #653, #774,
#1809). Here every section forbids extra keys, so a typo is an error that names its full path. Values
are validated in pydantic's strict mode, so `"enabled": "false"` or `"stage": true` are errors instead
of being coerced to something the user did not mean. The one relaxation is `Size`: element counts
such as `reduce_bucket_size` are commonly written `5e8` in DeepSpeed configs, so integral floats are
accepted there and become ints.
[Note: "auto"] As in DeepSpeed's pydantic sections, a value of "auto" inside a section means "use the
default"; the key is dropped before validation. Top-level batch keys treat "auto" as "derive me".
[Note: docstrings] Each field's attribute docstring is its entry in the config reference
(`use_attribute_docstrings`), reachable as `Model.model_fields[name].description`.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator


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
    def _drop_auto(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        return data


def _integral_float_to_int(value: Any) -> Any:
    # 5e8 parses as a float in JSON; DeepSpeed's pp_int fields accept it, so do we (but not 2.5).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Size = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An element count or byte size: an int, or a float with no fractional part such as 5e8."""
