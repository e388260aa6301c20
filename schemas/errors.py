"""`ConfigError`: every problem of a config, one line each; and the translation of pydantic's
ValidationError into those lines (users never see pydantic's multi-line dump).

Each line names the full key path (`zero_optimization.offload_optimizer.device`), the value, and
what is allowed; an unknown key gets the closest valid key ("did you mean ...?", difflib).
"""
from __future__ import annotations

import difflib
import json
import typing
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """All problems found in one config, one line each (``.problems``)."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__("\n".join(f"{where}{p}" for p in self.problems))


def show_value(value: Any, limit: int = 60) -> str:
    """A value as the user wrote it (JSON spelling), shortened to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, list, dict, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found


def _field_named(model: type[BaseModel], key: str) -> Optional[Any]:
    for name, field in model.model_fields.items():
        if key == name or key == field.alias:
            return field
    return None


def valid_keys(model: type[BaseModel]) -> list[str]:
    """Every key a section accepts: field names and their aliases."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(name)
        if field.alias and field.alias != name:
            keys.append(field.alias)
    return keys


def _walk(root: type[BaseModel], loc: Iterable[Any]) -> tuple[str, list[type[BaseModel]]]:
    """The user-facing key path of a pydantic `loc`, and the models that may sit at its end.

    pydantic inserts union branch labels (`int`, `literal['auto']`, a member class name or a
    discriminator tag) into `loc`; those are not keys the user wrote, so they are left out.
    """
    path, models = "", [root]
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        fields = [f for f in (_field_named(m, part) for m in models) if f is not None]
        if fields:
            path = f"{path}.{part}" if path else part
            models = [m for f in fields for m in _models_in(f.annotation)]
        elif any(m.__name__ == part for m in models):
            models = [m for m in models if m.__name__ == part]
        elif models:  # a key the schema does not define (reported by a validator): keep it
            path, models = f"{path}.{part}" if path else part, []
    return path, models


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _unknown_key_line(path: str, key: str, value: Any, models: list[type[BaseModel]]) -> str:
    where = _join(path, key)
    keys = sorted({k for m in models for k in valid_keys(m)})
    for model in models:
        field = model.model_fields.get(key)
        if field is not None and field.alias and field.alias != key:
            return f"{where}: given twice, as '{key}' and as its alias '{field.alias}'; keep one"
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(keys)}"
    return f"{where}: unknown key (value {show_value(value)}); {hint}"


def _detail(error: dict) -> str:
    kind, msg = error["type"], error["msg"]
    if kind == "literal_error":
        return f"expected {error['ctx']['expected']}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected an object (a section with keys)"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    for words, symbol in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                          ("greater than", ">"), ("less than", "<")):
        msg = msg.replace(words, symbol)
    return msg.replace("Input should be", "expected", 1)


def problems_from_validation_error(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem in `error`, each naming its key path relative to `root`."""
    lines: dict[str, list[str]] = {}
    for item in error.errors():
        loc = item["loc"]
        if item["type"] == "extra_forbidden":
            path, models = _walk(root, loc[:-1])
            line = _unknown_key_line(path, str(loc[-1]), item.get("input"), models)
            lines.setdefault(line, [])
            continue
        path, _ = _walk(root, loc)
        if item["type"] == "missing":
            lines.setdefault(f"{path or '(config)'}: required key is missing", [])
            continue
        # Union branches each report on the same key: gather them into one line.
        head = f"{path or '(config)'}: {show_value(item.get('input'))} is not valid"
        details = lines.setdefault(head, [])
        if _detail(item) not in details:
            details.append(_detail(item))
    return [f"{head}: {_either(details)}" if details else head for head, details in lines.items()]


def _either(details: list[str]) -> str:
    if len(details) > 1 and all(d.startswith("expected ") for d in details):
        return "expected " + " or ".join(d.removeprefix("expected ") for d in details)
    return " or ".join(details)
