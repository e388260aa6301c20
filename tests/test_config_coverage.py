"""Every key of the schema does what it says: the runtime reads it, `schemas/unbuilt.py` rejects the
values that are not built, or `schemas/by_construction.py` says (with the README and the field's
docstring) why dstrain meets its purpose without reading it. A new key that nothing reads fails here.

"Read" is checked in the source of engine/, ops/ and offload/: an attribute access with the field's
name (for a name several sections share, on the section's own name, e.g. `fp16.enabled`), or, for a
params model the runtime hands over whole (`**params.model_dump()`), a named parameter of the class
it is handed to. A key with a single allowed value (`gradient_compression.type: "powersgd"`) can
only say what dstrain does, so it needs no reader.
"""
from __future__ import annotations

import ast
import inspect
import typing
from collections import Counter
from pathlib import Path

import ops
from engine.schedules import SCHEDULES
from schemas.by_construction import BY_CONSTRUCTION
from schemas.base import StrictModel
from schemas.config import Config
from schemas.errors import _models_in
from schemas.optimizer import PARAMS_MODELS as OPTIMIZER_PARAMS
from schemas.scheduler import PARAMS_MODELS as SCHEDULER_PARAMS
from schemas.unbuilt import UNBUILT

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("engine", "ops", "offload")
# Where the runtime names a section by another variable: `cfg.type` in engine/optimizers.py.
RECEIVERS = {"optimizer": {"cfg"}, "scheduler": {"cfg"}}
CONSUMED_WHOLE = {**{SCHEDULER_PARAMS[name]: cls for name, cls in SCHEDULES.items()},
                  **{OPTIMIZER_PARAMS[name]: getattr(ops, name)
                     for name in ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")}}


def runtime_attributes() -> set[tuple[str | None, str]]:
    """(receiver name, attribute) of every attribute access in the runtime's source."""
    found = set()
    for folder in RUNTIME:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute):
                    value = node.value
                    receiver = value.id if isinstance(value, ast.Name) else getattr(value, "attr", None)
                    found.add((receiver, node.attr))
    return found


def leaves(model=Config, prefix: str = "", parent: str | None = None, seen: tuple = ()):
    """(path, parent key, field name, model) of every leaf field under `model`."""
    for name, field in model.model_fields.items():
        inner = [m for m in _models_in(field.annotation) if m not in seen]
        if not inner:
            yield f"{prefix}{name}", parent, name, model
        for sub in inner:
            yield from leaves(sub, f"{prefix}{name}.", name, (*seen, model))


def field_counts() -> Counter:
    models, todo = set(), [Config]
    while todo:
        model = todo.pop()
        if model not in models:
            models.add(model)
            todo.extend(m for f in model.model_fields.values() for m in _models_in(f.annotation))
    return Counter(name for model in models for name in model.model_fields)


def listed_unbuilt(path: str) -> bool:
    for row in UNBUILT:
        section = row.path.rsplit(".", 1)[0]
        gates = row.path.endswith((".enabled", ".device"))  # the section's other keys act only once it is on
        if path == row.path or path.startswith(row.path + ".") or (gates and path.startswith(section + ".")):
            return True
    return False


def consumed_whole(model, name: str) -> bool:
    parameter = inspect.signature(CONSUMED_WHOLE[model]).parameters.get(name)
    return parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD


def has_one_value(model, name: str) -> bool:
    annotation = model.model_fields[name].annotation
    return typing.get_origin(annotation) is typing.Literal and len(typing.get_args(annotation)) == 1


def is_read(parent, name, model, attributes, counts) -> bool:
    if has_one_value(model, name):
        return True
    if model in CONSUMED_WHOLE:
        return consumed_whole(model, name)
    if counts[name] == 1:
        return any(attr == name for _, attr in attributes)
    return any((receiver, name) in attributes for receiver in {parent} | RECEIVERS.get(parent, set()))


def test_every_field_is_read_listed_as_unbuilt_or_met_by_construction():
    attributes, counts = runtime_attributes(), field_counts()
    ignored = [path for path, parent, name, model in leaves()
               if not (listed_unbuilt(path) or path in BY_CONSTRUCTION
                       or is_read(parent, name, model, attributes, counts))]
    assert ignored == [], f"accepted but nothing reads them: {ignored}"


def test_keys_met_by_construction_say_why_in_their_docstring_and_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    paths = {path: model.model_fields[name] for path, _, name, model in leaves()}
    for path in BY_CONSTRUCTION:
        assert "By construction:" in " ".join(paths[path].description.split()), path
        assert f"`{path}`" in readme, path


class Probe(StrictModel):
    brand_new_key: int = 0
    """A key no code reads."""
    enabled: bool = False
    """A name several sections share."""


def test_the_check_catches_a_key_nothing_reads():
    attributes, counts = runtime_attributes(), field_counts()
    assert not is_read("zero_optimization", "brand_new_key", Probe, attributes, counts | {"brand_new_key": 1})
    assert not is_read("comms_logger", "enabled", Probe, attributes, counts)  # shared name, another section's
    assert is_read("fp16", "enabled", Probe, attributes, counts)
