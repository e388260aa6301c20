"""schemas: the config language (DeepSpeed's JSON schema plus a few dstrain keys).

    config = schemas.load_config("ds_config.json", world_size=4)   # or a dict, YAML, base64 JSON
    config.zero_optimization.reduce_bucket_size                       # typed, frozen, resolved

Every problem in a config is reported at once in one `ConfigError` (one line per problem, each
naming its key path). Sections: `schemas/config.py` lists them; field docstrings are the reference.
"""
from __future__ import annotations

import os
from typing import Any, Union

from pydantic import ValidationError

from schemas.base import StrictModel
from schemas.batch import BatchSizes, derive_batch_sizes, given_batch_keys
from schemas.checks import cross_field_problems
from schemas.config import BATCH_KEYS, Config
from schemas.deprecated import ConfigDeprecationWarning, map_deprecated_keys
from schemas.errors import ConfigError, problems_from_validation_error
from schemas.loading import read_config_source
from schemas.unbuilt import unbuilt_problems

ConfigSource = Union[dict, str, os.PathLike, Config]

__all__ = ["Config", "ConfigError", "ConfigDeprecationWarning", "StrictModel", "load_config"]


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError([f"world_size: {world_size!r} is not valid: expected a positive integer"])


def _validate(body: dict) -> tuple[Config | None, list[str]]:
    """The Config built from `body`, or None and the schema's problem lines."""
    try:
        config = Config.model_validate(body)
    except ValidationError as err:
        return None, problems_from_validation_error(err, Config)
    return config, cross_field_problems(config) + unbuilt_problems(config)


def _resolve(raw: dict, world_size: int) -> tuple[Config | None, dict, list[str]]:
    mapped, problems = map_deprecated_keys(raw)
    given, value_problems = given_batch_keys(mapped)
    sizes, batch_problems = (None, []) if value_problems else derive_batch_sizes(given, world_size)
    problems += value_problems + batch_problems
    # With unusable batch keys, placeholders still let every other section be checked in this pass.
    sizes = sizes or BatchSizes(1, 1, 1)
    body = {k: v for k, v in mapped.items() if k not in BATCH_KEYS}
    body.update(train_batch_size=sizes.train_batch_size,
                train_micro_batch_size_per_gpu=sizes.train_micro_batch_size_per_gpu,
                gradient_accumulation_steps=sizes.gradient_accumulation_steps)
    config, schema_problems = _validate(body)
    return config, given, problems + schema_problems


def load_config(source: ConfigSource, world_size: int = 1) -> Config:
    """Load, validate and resolve a config for a data-parallel group of `world_size` ranks.

    `source`: a dict; a path to a `.json` file (comments allowed, duplicate keys rejected) or a
    `.yaml`/`.yml` file; a urlsafe-base64 JSON string (as DeepSpeed accepts); or a `Config`, returned
    as is when its world size matches and re-resolved from its given batch keys otherwise.
    Raises `ConfigError` listing every problem found. Deprecated keys are mapped with a
    `ConfigDeprecationWarning`.
    """
    _check_world_size(world_size)
    if isinstance(source, Config):
        if source.world_size == world_size:
            return source
        raw, origin = {k: v for k, v in source.to_dict().items() if k not in BATCH_KEYS}, None
        raw.update(source.given_batch_keys)
    else:
        raw, origin = read_config_source(source)
    if not isinstance(raw, dict):
        raise ConfigError([f"the config must be an object (a mapping of keys), not {type(raw).__name__}"], origin)
    config, given, problems = _resolve(raw, world_size)
    if problems or config is None:
        raise ConfigError(problems, origin)
    config._world_size = world_size
    config._given_batch = given
    return config
