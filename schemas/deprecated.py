"""Deprecated DeepSpeed keys, mapped to their replacements with a warning before validation.

One table row per renamed key. Giving an old key together with its replacement is an error (as in
DeepSpeed), never a silent choice of one. Unlike DeepSpeed, `aio.thread_count` (renamed to
`intra_op_parallelism` in DeepSpeed #7056, and silently ignored there since) is mapped too.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from schemas.errors import show_value

_DROP = object()  # a converter's answer for "the old key maps to nothing" (e.g. cpu_offload: false)


class ConfigDeprecationWarning(FutureWarning):
    """A deprecated config key was used and mapped to its replacement."""


def _offload_to_cpu(path: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {show_value(value)} is not valid: expected true or false")
        return {"device": "cpu"} if value else _DROP
    return convert


@dataclass(frozen=True)
class Renamed:
    """`section.old` is now `new_section.new` (new_section defaults to section)."""

    section: tuple[str, ...]
    old: str
    new: str
    new_section: Optional[tuple[str, ...]] = None
    convert: Optional[Callable[[Any], Any]] = None
    same_as_new: tuple[str, ...] = ()  # other spellings of the new key (pydantic aliases)

    @property
    def old_path(self) -> str:
        return ".".join((*self.section, self.old))

    @property
    def new_path(self) -> str:
        return ".".join((*(self.new_section if self.new_section is not None else self.section), self.new))


RENAMED = (
    Renamed(("zero_optimization",), "cpu_offload", "offload_optimizer",
            convert=_offload_to_cpu("zero_optimization.cpu_offload")),
    Renamed(("zero_optimization",), "cpu_offload_param", "offload_param",
            convert=_offload_to_cpu("zero_optimization.cpu_offload_param")),
    Renamed(("zero_optimization",), "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save", same_as_new=("gather_16bit_weights_on_model_save",)),
    Renamed(("aio",), "thread_count", "intra_op_parallelism"),
    Renamed((), "allgather_size", "allgather_bucket_size", new_section=("zero_optimization",)),
)


def _section(raw: dict, path: tuple[str, ...], create: bool) -> Optional[dict]:
    node = raw
    for key in path:
        if create and key not in node:
            node[key] = {}
        node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None
    return node


def _warn(message: str) -> None:
    warnings.warn(message, ConfigDeprecationWarning, stacklevel=4)


def _apply_renamed(raw: dict, rule: Renamed, problems: list[str]) -> None:
    section = _section(raw, rule.section, create=False)
    if section is None or rule.old not in section:
        return
    target = _section(raw, rule.new_section if rule.new_section is not None else rule.section, create=True)
    if target is None:
        return  # the new section has the wrong type; validation reports it
    taken = [k for k in (rule.new, *rule.same_as_new) if k in target]
    if taken:
        problems.append(f"{rule.old_path}: deprecated key given together with its replacement "
                        f"'{rule.new_path}'; remove '{rule.old_path}'")
        return
    value = section.pop(rule.old)
    try:
        value = rule.convert(value) if rule.convert else value
    except ValueError as err:
        problems.append(str(err))
        return
    if value is not _DROP:
        target[rule.new] = value
    _warn(f"config key '{rule.old_path}' is deprecated; use '{rule.new_path}' instead (mapped)")


def _apply_pin_memory(raw: dict, problems: list[str]) -> None:
    # cpu_offload_use_pin_memory has no single replacement: it applies to whichever offload sections exist.
    zero = _section(raw, ("zero_optimization",), create=False)
    if zero is None or "cpu_offload_use_pin_memory" not in zero:
        return
    value = zero.pop("cpu_offload_use_pin_memory")
    old = "zero_optimization.cpu_offload_use_pin_memory"
    if not isinstance(value, bool):
        problems.append(f"{old}: {show_value(value)} is not valid: expected true or false")
        return
    sections = [k for k in ("offload_param", "offload_optimizer") if isinstance(zero.get(k), dict)]
    for key in sections:
        if "pin_memory" in zero[key]:
            problems.append(f"{old}: deprecated key given together with its replacement "
                            f"'zero_optimization.{key}.pin_memory'; remove '{old}'")
            return
    for key in sections:
        zero[key]["pin_memory"] = value
    targets = " and ".join(f"zero_optimization.{k}.pin_memory" for k in sections) or "nothing (no offload section)"
    _warn(f"config key '{old}' is deprecated; use offload_param/offload_optimizer.pin_memory "
          f"instead (mapped to {targets})")


def _apply_boolean_zero(raw: dict, problems: list[str]) -> None:
    # DeepSpeed's oldest form: "zero_optimization": true means stage 1, false means stage 0.
    value = raw.get("zero_optimization")
    if not isinstance(value, bool):
        return
    raw["zero_optimization"] = {"stage": 1} if value else {}
    _warn("config key 'zero_optimization' as a boolean is deprecated; use "
          f"{{\"stage\": {1 if value else 0}}} instead (mapped)")


def map_deprecated_keys(raw: dict) -> tuple[dict, list[str]]:
    """Return a copy of `raw` with deprecated keys mapped, and the problems found doing so."""
    mapped = copy.deepcopy(raw)
    problems: list[str] = []
    _apply_boolean_zero(mapped, problems)
    for rule in RENAMED:
        _apply_renamed(mapped, rule, problems)
    _apply_pin_memory(mapped, problems)
    return mapped, problems
