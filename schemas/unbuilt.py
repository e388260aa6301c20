"""Config keys whose feature dstrain has not built yet: rejected, never silently ignored.

[Note: one row per key] Each row of `UNBUILT` names a key path (a leaf or a whole section). A config
is rejected when the value there differs from its schema default (or, with `built`, is not one of
the values that are built). When a feature lands, delete its row and nothing else. Optimizer and
scheduler types that are not built are rejected by `schemas/optimizer.py` / `schemas/scheduler.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from pydantic import BaseModel

from schemas.errors import show_value


@dataclass(frozen=True)
class Unbuilt:
    """A key whose non-default values are rejected; `built` (if given) says which values are fine."""

    path: str
    hint: str = ""
    built: Optional[Callable[[Any], bool]] = None
    permanent: bool = False  # never going to be built: say "not supported", not "not built yet"


UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt("zero_optimization.offload_param.device", 'use "none"'),
    Unbuilt("zero_optimization.offload_optimizer.device", 'use "none"'),
    Unbuilt("aio"),
    Unbuilt("activation_checkpointing"),
    Unbuilt("sparse_attention", "remove the section"),
    Unbuilt("pipeline"),
    Unbuilt("tensorboard.enabled"),
    Unbuilt("csv_monitor.enabled"),
    Unbuilt("wandb.enabled"),
    Unbuilt("comet.enabled"),
    Unbuilt("comms_logger.enabled"),
    Unbuilt("flops_profiler.enabled"),
    Unbuilt("elasticity.enabled"),
    Unbuilt("amp.enabled", "use fp16 or bf16", permanent=True),
    Unbuilt("sparse_gradients"),
    Unbuilt("checkpoint.use_node_local_storage", "use a shared file system (the default)"),
    Unbuilt("checkpoint.parallel_write"),
)


def _value_and_default(config: BaseModel, path: str) -> Optional[tuple[Any, Any]]:
    """The value at `path` and the schema default there; None when a section on the way is absent."""
    node: Any = config
    default: Any = None
    for key in path.split("."):
        if node is None:
            return None
        default = type(node).model_fields[key].get_default(call_default_factory=True)
        node = getattr(node, key)
    return node, default


def _differences(path: str, value: Any, default: Any) -> Iterator[tuple[str, Any, Any]]:
    """(path, value, default) of every leaf where `value` differs from `default`."""
    if isinstance(value, BaseModel) and type(value) is type(default):
        for key in type(value).model_fields:
            yield from _differences(f"{path}.{key}", getattr(value, key), getattr(default, key))
    elif value != default:
        yield path, value, default


def _line(row: Unbuilt, path: str, value: Any, default: Any) -> str:
    if isinstance(value, BaseModel) and default is None:
        what = "the section"
    else:
        what = show_value(value)
    status = "is not supported by dstrain" if row.permanent else "is not built yet in dstrain"
    hint = row.hint or (f"remove it or use the default {show_value(default)}" if default is not None
                        else "remove it")
    return f"{path}: {what} {status}; {hint}"


def unbuilt_problems(config: BaseModel) -> list[str]:
    """One line per key of `config` that asks for a feature dstrain does not have."""
    problems = []
    for row in UNBUILT:
        found = _value_and_default(config, row.path)
        if found is None:
            continue
        value, default = found
        if row.built is not None:
            if not row.built(value):
                problems.append(_line(row, row.path, value, default))
            continue
        problems.extend(_line(row, path, v, d) for path, v, d in _differences(row.path, value, default))
    return problems
