"""`"auto"`: a value a host program (HF Trainer / Accelerate) fills in before the engine sees it.

40 of 80 public DeepSpeed configs measured are HF templates. HF replaces each "auto" with a value of
its TrainingArguments (lr, betas, batch sizes, ...) or of the model (bucket sizes from hidden_size)
before DeepSpeed reads the file. dstrain never guesses a hyper-parameter in its place:

- an "auto" that no one filled is an error naming the key and the three ways to supply it: the
  `config_overrides={"optimizer.params.lr": 3e-4}` argument of `engine.initialize` (and
  `load_config`), `dstrain check-config --set optimizer.params.lr=3e-4`, or
  `schemas.hf_auto_values(config, training_args, model_config)`, which fills them as HF Trainer does;
- batch keys: an "auto" is derived when the two other batch keys are given (their product fixes it);
  otherwise it is the error above (`schemas/batch.py`);
- `AUTO_DEFAULTS`: performance tunables whose "auto" HF derives from the model's hidden size. They
  change neither the math nor what a step computes, so without a value they take DeepSpeed's default,
  with a `ConfigAutoWarning` that names the key and the value used;
- `AUTO_KEPT`: keys where "auto" is a value the schema itself resolves (`overlap_comm`: by stage).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator

from schemas.base import is_comment_key
from schemas.config import BATCH_KEYS
from schemas.errors import show_value

AUTO_KEPT = ("zero_optimization.overlap_comm", "pipeline.stages")
# path -> what HF Trainer fills it with; each spelling of a key is listed.
AUTO_DEFAULTS = {
    "zero_optimization.reduce_bucket_size": "hidden_size**2",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size**2",
    "zero_optimization.prefetch_bucket_size": "0.9 * hidden_size**2",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size",
    "zero_optimization.param_persistence_threshold": "10 * hidden_size",
}
HOW_TO_SUPPLY = ("engine.initialize(config_overrides={{\"{path}\": ...}}), dstrain check-config --set "
                 "{path}=VALUE, or schemas.hf_auto_values(config, training_args)")


class ConfigAutoWarning(UserWarning):
    """An "auto" tunable no host program filled took DeepSpeed's default."""


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def auto_paths(raw: Any, prefix: str = "") -> Iterator[str]:
    """The dotted path of every "auto" value in `raw` (comment keys skipped)."""
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if is_comment_key(key):
            continue
        path = f"{prefix}{key}"
        if is_auto(value):
            yield path
        else:
            yield from auto_paths(value, f"{path}.")


def unfilled_line(path: str) -> str:
    """The problem line for an "auto" that must be supplied."""
    return (f"{path}: \"auto\" was not filled (HF Trainer/Accelerate fill it before the engine reads the "
            f"config); supply it: {HOW_TO_SUPPLY.format(path=path)}")


def _drop(raw: dict, path: str) -> None:
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    del node[last]


def resolve_auto(raw: dict) -> tuple[list[str], list[str]]:
    """Drop every "auto" of `raw` in place that the schema must not see. Returns the problem lines
    (unfilled hyper-parameters) and the batch keys left "auto" for `schemas/batch.py`."""
    problems, batch = [], []
    for path in list(auto_paths(raw)):
        if path in BATCH_KEYS:
            batch.append(path)
        elif path in AUTO_KEPT:
            continue
        elif path in AUTO_DEFAULTS:
            _drop(raw, path)
            warnings.warn(f"{path}: \"auto\" not filled (HF Trainer would use {AUTO_DEFAULTS[path]}); "
                          "using DeepSpeed's default", ConfigAutoWarning, stacklevel=4)
        else:
            _drop(raw, path)
            problems.append(unfilled_line(path))
    return problems, batch


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> list[str]:
    """Set each dotted `path: value` of `overrides` in `raw` (in place), making sections as needed.
    Returns problem lines for paths that run through a value that is not a section."""
    problems = []
    for path, value in overrides.items():
        *parents, last = str(path).split(".")
        node, where = raw, []
        for key in parents:
            where.append(key)
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                problems.append(f"{path}: cannot set it, {'.'.join(where)} is {show_value(child)}, not a section")
                break
            node = child
        else:
            node[last] = value
    return problems
