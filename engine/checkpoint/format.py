"""The on-disk layout of a dstrain checkpoint, its metadata, and the checksums that guard it.

    <save_dir>/latest                      the committed tag (text, replaced atomically)
    <save_dir>/<tag>/metadata.json         rank 0: world size, stage, precision, counters, config,
                                           and per parameter: shape, dtype, kinds, fragments
    <save_dir>/<tag>/engine_state.pt       rank 0: scheduler, loss scaler, optimizer hyperparameters,
                                           sampler position, client_state
    <save_dir>/<tag>/rank_00003.pt         global rank 3: its fragments (below) and its RNG states
                                           (coordinates in metadata.json: placement.py's note)
    <save_dir>/<tag>/manifest.json         sha256 and size of every file above
    <save_dir>/.<tag>.tmp-<nonce>/         a save in progress (never loaded, removed by the next save)

[Note: fragments] The unit on disk is the per-parameter fragment: rows [start, stop) of dim 0 of one
parameter (torch.chunk semantics, as ZeRO partitions; a 0-d parameter counts as one row), for every
kind of tensor the parameter has: "fp32" (master weights, or the weights themselves without masters),
each optimizer state tensor shaped like the parameter ("exp_avg", ...), and scalar state ("step"),
which every fragment repeats. Frozen parameters and buffers are kind "module", written whole by rank
0. A rank file maps "<name>::<kind>" to its fragment; metadata.json lists which rank holds which rows,
so a reader at any world size and stage reads just the rows it needs.
[Note: weights_only] Every .pt file holds only tensors and plain containers/numbers/strings, and is
read with `torch.load(weights_only=True)`: loading a checkpoint cannot execute code.
[Note: untrusted files] A checkpoint directory may be shared or copied from elsewhere, so what it
says is checked before use: the tag `latest` names is validated as at save (a name inside the
directory, never `../x` or a path), `latest` is read without following a link, and dtype names in
metadata.json resolve only through `SAVED_DTYPES`. The other way round, files are often readable by
everyone (the umask), so config values whose key names a credential (`comet.api_key`, any
`*token*`, `*password*`, `*secret*`) are written as `REDACTED`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .blockio import HashingFile, file_digest  # noqa: F401 - HashingFile is used by writer.py

FORMAT_NAME = "dstrain-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
METADATA = "metadata.json"
MANIFEST = "manifest.json"
ENGINE_STATE = "engine_state.pt"
SEP = "::"
FP32, MODULE = "fp32", "module"  # kinds of weights (module note: fragments)
_TMP = re.compile(r"^\.(?P<tag>.+)\.tmp-[0-9a-f]+$")
_MAX_LATEST = 4096  # bytes of `latest` read: a tag is one directory name
REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"api_?key|token|password|passwd|secret|credential|private_?key|access_?key", re.I)
# Every dtype a parameter or buffer can have in a checkpoint (names as str(dtype) minus "torch.").
SAVED_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool", "uint8", "uint16",
    "uint32", "uint64", "int8", "int16", "int32", "int64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz") if isinstance(getattr(torch, name, None), torch.dtype)}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, corrupted, truncated or incompatible."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def tensor_key(name: str, kind: str) -> str:
    return f"{name}{SEP}{kind}"


def tmp_dir(save_dir: Path, tag: str, nonce: str) -> Path:
    return save_dir / f".{tag}.tmp-{nonce}"


def is_tmp_dir(path: Path) -> bool:
    return bool(_TMP.match(path.name))


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST or "\n" in tag or "\0" in tag:
        raise ValueError(f"checkpoint tag {tag!r} is not usable as a directory name: no '/', no leading "
                         f"'.', not {LATEST!r}")
    return tag


def tag_path(ckpt_dir: Path, tag: str, source: str) -> Path:
    """`ckpt_dir/tag` for a tag from `source` (a flag, or the `latest` file), validated as at save."""
    try:
        return Path(ckpt_dir) / validate_tag(tag)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}; name one of the tags in {ckpt_dir} "
                              f"({', '.join(committed_tags(Path(ckpt_dir))) or 'none'})") from None


def dtype_named(name: str, where: str) -> torch.dtype:
    if name not in SAVED_DTYPES:
        raise CheckpointError(f"{where}: dtype {name!r} is not a tensor dtype; the file is damaged or not "
                              "written by dstrain")
    return SAVED_DTYPES[name]


def redact_secrets(obj):
    """A copy of `obj` (JSON-like) with every non-empty value under a credential-like key replaced."""
    if isinstance(obj, dict):
        return {k: REDACTED if _SECRET_KEY.search(str(k)) and obj[k] not in (None, "") else redact_secrets(obj[k])
                for k in obj}
    if isinstance(obj, (list, tuple)):
        return [redact_secrets(v) for v in obj]
    return obj


# -- checksums -----------------------------------------------------------------------------------
def check_file(path: Path, entry: dict) -> str | None:
    """None when `path` matches its manifest entry, else what is wrong (one short phrase)."""
    if not path.exists():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"truncated or resized ({size} bytes, manifest says {entry['bytes']})"
    if file_digest(path)[0] != entry["sha256"]:
        return "sha256 mismatch (corrupted)"
    return None


# -- small JSON files, written atomically ----------------------------------------------------------
def write_json(path: Path, obj) -> dict:
    data = json.dumps(obj, indent=1, sort_keys=False).encode()
    f = HashingFile(path)
    f.write(data)
    return f.close()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted or truncated ({e})") from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(save_dir: Path, tag: str) -> None:
    """Point `latest` at `tag`: a temp file renamed over the old pointer (atomic on POSIX)."""
    tmp = save_dir / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


def read_latest(save_dir: Path) -> str | None:
    """The tag `latest` names, validated as at save (module note: untrusted files), or None."""
    path = Path(save_dir) / LATEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink, which write_latest never makes
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}); it must be a plain file naming a tag") from None
    with os.fdopen(fd, "rb") as f:
        text = f.read(_MAX_LATEST + 1).decode("utf-8", errors="replace").strip()
    if not text:
        return None
    if len(text) > 255:  # NAME_MAX: no directory of that name can exist
        raise CheckpointError(f"{path}: names a tag of {len(text)}+ characters, not a checkpoint tag; fix or delete it")
    tag_path(Path(save_dir), text, f"{path} (the `latest` pointer)")
    return text


def committed_tags(save_dir: Path) -> list[str]:
    """Tags with a manifest, oldest first (by the step recorded in their metadata, then name)."""
    tags = []
    for d in save_dir.iterdir() if save_dir.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).exists():
            tags.append(d)
    def order(d: Path):
        try:
            return (json.loads((d / METADATA).read_text())["counters"]["global_steps"], d.stat().st_mtime)
        except (OSError, ValueError, KeyError):
            return (-1, d.stat().st_mtime)
    return [d.name for d in sorted(tags, key=order)]
