"""Reading a config source into a plain dict: a dict, a JSON or YAML file, or base64 JSON.

JSON files may contain `//` and `/* */` comments outside strings (DeepSpeed reads them with hjson).
Duplicate keys are errors in both formats (DeepSpeed: `dict_raise_error_on_duplicate_keys`), since
the second value silently winning is a classic source of "my setting has no effect".
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from schemas.errors import ConfigError

YAML_SUFFIXES = (".yaml", ".yml")


def strip_json_comments(text: str) -> str:
    """`text` with `//` and `/* */` comments outside strings replaced by spaces.

    Newlines inside comments are kept, so JSON error positions still match the file.
    """
    out, i, n = [], 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end == -1 else end
            out.append(" " * (end - i))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end == -1 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def parse_json_text(text: str, where: str) -> Any:
    """Parse JSON (comments allowed); every duplicate key is a problem naming the key and `where`."""
    duplicates: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        result: dict = {}
        for key, value in pairs:
            if key in result:
                duplicates.append(f"duplicate key '{key}' in {where}; each key may appear once per section")
            result[key] = value
        return result

    try:
        data = json.loads(strip_json_comments(text), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError([f"invalid JSON in {where} at line {err.lineno} column {err.colno}: {err.msg}"]) from None
    if duplicates:
        raise ConfigError(duplicates)
    return data


class _StrictYamlLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys and reads `5e8` as a number (YAML 1.1 wants `5.0e+8`)."""

    duplicates: list[str]


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            loader.duplicates.append(
                f"duplicate key '{key}' at line {key_node.start_mark.line + 1}; each key may appear once per section")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_yaml_text(text: str, where: str) -> Any:
    """Parse YAML with duplicate keys rejected."""
    loader = _StrictYamlLoader(text)
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as err:
        raise ConfigError([f"invalid YAML in {where}: {' '.join(str(err).split())}"]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"{line} in {where}" for line in loader.duplicates])
    return data


def _decode_base64_json(text: str) -> Any:
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    if not decoded.lstrip().startswith("{"):
        return None
    return parse_json_text(decoded, "the base64 config")


def read_config_source(source: Any) -> tuple[dict, str | None]:
    """The raw config dict of `source`, and the file it came from (None for dicts and base64)."""
    if isinstance(source, dict):
        return source, None
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            data = parse_yaml_text(text, str(path)) if path.suffix.lower() in YAML_SUFFIXES \
                else parse_json_text(text, str(path))
            if not isinstance(data, dict):
                raise ConfigError([f"the config in {path} must be an object (a mapping of keys), "
                                   f"not {type(data).__name__}"])
            return data, str(path)
        if isinstance(source, str):
            decoded = _decode_base64_json(source)
            if isinstance(decoded, dict):
                return decoded, None
        raise ConfigError([f"config file not found: {str(source)[:200]!r} "
                           "(expected a path to an existing .json/.yaml file or a urlsafe-base64 JSON string)"])
    raise ConfigError([f"cannot read a config from {type(source).__name__}: expected a dict, a path to a "
                       ".json/.yaml file, or a urlsafe-base64 JSON string"])
