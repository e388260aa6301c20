"""schemas: the config language (DeepSpeed's JSON schema plus a few dstrain keys).

    config = schemas.load_config("ds_config.json", world_size=4)   # or a dict, YAML, base64 JSON
    config.zero_optimization.reduce_bucket_size                       # typed, frozen, resolved

Every problem in a config is reported at once in one `ConfigError` (one line per problem, each
naming its key path). Sections: `schemas/config.py` lists them; field docstrings are the reference.
The order of a load: `overrides` set → deprecated keys mapped → DeepSpeed sections without a schema
reported (`unbuilt.py`) → "auto" resolved (`auto.py`) → batch keys derived (`batch.py`) → the
schema, then the cross-field rules (`checks.py`) and the not-built keys (`unbuilt.py`).
`hf_auto_values` computes a template's "auto" values as HF Trainer would (`hf_auto.py`).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional, Union

from pydantic import ValidationError

from schemas.auto import ConfigAutoWarning, apply_overrides, resolve_auto
from schemas.base import StrictModel
from schemas.batch import BatchSizes, derive_batch_sizes, given_batch_keys
from schemas.checks import cross_field_problems
from schemas.config import BATCH_KEYS, Config
from schemas.deprecated import ConfigDeprecationWarning, map_deprecated_keys
from schemas.errors import ConfigError, problems_from_validation_error
from schemas.loading import read_config_source
from schemas.hf_auto import hf_auto_values
from schemas.unbuilt import not_built_sections, unbuilt_problems

ConfigSource = Union[dict, str, os.PathLike, Config]

__all__ = ["Config", "ConfigAutoWarning", "ConfigError", "ConfigDeprecationWarning", "StrictModel",
           "hf_auto_values", "load_config"]

_MAX_PASSES = 8  # schema passes, each leaving out the keys the previous one rejected


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError([f"world_size: {world_size!r} is not valid: expected a positive integer"])


def _rejected_key(body: dict, loc: tuple) -> Optional[tuple[dict, Any]]:
    """The (section, key) of `body` a validation error points at, or its deepest existing section.
    `loc` may hold pydantic's union branch labels, which name no key; they are skipped."""
    node, found = body, None
    for part in loc:
        if isinstance(node, dict) and part in node:
            found, node = (node, part), node[part]
        elif isinstance(node, list):
            break  # a bad list item: the whole list goes
    return found


def _drop_rejected(body: dict, err: ValidationError) -> bool:
    """Remove every key `err` rejected from `body` (each once); False when there was none to remove."""
    targets = {(id(section), key): (section, key) for section, key in
               filter(None, (_rejected_key(body, item["loc"]) for item in err.errors()))}
    for section, key in targets.values():
        section.pop(key, None)  # a section may go before a key inside it
    return bool(targets)


def _validate(body: dict) -> tuple[Config | None, list[str]]:
    """The Config built from `body` and every problem line: the schema's, then, on the config the
    schema accepts once the keys it rejected are left out, the cross-field and not-built ones, so one
    pass reports every problem of the file."""
    body, problems = copy.deepcopy(body), []
    for attempt in range(_MAX_PASSES):
        try:
            config = Config.model_validate(body)
        except ValidationError as err:
            if attempt == 0:  # later passes only repeat these (or miss a key the first one dropped)
                problems = problems_from_validation_error(err, Config)
            if not _drop_rejected(body, err):
                return None, problems
            continue
        later = cross_field_problems(config) + unbuilt_problems(config)
        return (config if not problems else None), problems + later
    return None, problems


def _resolve(raw: dict, world_size: int, overrides: dict) -> tuple[Config | None, dict, list[str]]:
    problems = apply_overrides(raw, overrides)
    mapped, deprecated = map_deprecated_keys(raw)
    mapped, sections = not_built_sections(mapped)
    auto_problems, auto_batch = resolve_auto(mapped)
    given, value_problems = given_batch_keys(mapped)
    sizes, batch_problems = (None, []) if value_problems else derive_batch_sizes(given, world_size, tuple(auto_batch))
    problems += deprecated + sections + auto_problems + value_problems + batch_problems
    # With unusable batch keys, placeholders still let every other section be checked in this pass.
    sizes = sizes or BatchSizes(1, 1, 1)
    body = {k: v for k, v in mapped.items() if k not in BATCH_KEYS}
    body.update(train_batch_size=sizes.train_batch_size,
                train_micro_batch_size_per_gpu=sizes.train_micro_batch_size_per_gpu,
                gradient_accumulation_steps=sizes.gradient_accumulation_steps)
    config, schema_problems = _validate(body)
    return config, given, problems + schema_problems


def load_config(source: ConfigSource, world_size: int = 1, overrides: Optional[dict[str, Any]] = None) -> Config:
    """Load, validate and resolve a config for a data-parallel group of `world_size` ranks.

    `source`: a dict; a path to a `.json` file (comments allowed, duplicate keys rejected) or a
    `.yaml`/`.yml` file; a urlsafe-base64 JSON string (as DeepSpeed accepts); or a `Config`, returned
    as is when its world size matches (and there are no overrides) and re-resolved otherwise.
    `overrides`: `{"dotted.key.path": value}` set before validation, e.g. the values of "auto" keys
    (`schemas/auto.py`). Raises `ConfigError` listing every problem found. Deprecated keys are
    mapped with a `ConfigDeprecationWarning`.
    """
    _check_world_size(world_size)
    if isinstance(source, Config):
        if source.world_size == world_size and not overrides:
            return source
        raw, origin = {k: v for k, v in source.to_dict().items() if k not in BATCH_KEYS}, None
        raw.update(source.given_batch_keys)
    else:
        raw, origin = read_config_source(source)
        raw = copy.deepcopy(raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        raise ConfigError([f"the config must be an object (a mapping of keys), not {type(raw).__name__}"], origin)
    config, given, problems = _resolve(raw, world_size, dict(overrides or {}))
    if problems or config is None:
        raise ConfigError(problems, origin)
    config._world_size = world_size
    config._given_batch = given
    return config
