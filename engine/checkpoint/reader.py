"""Reading a checkpoint: find the tag, verify its files, and assemble any rows of any parameter.

[Note: resharding] A reader never needs the saving run's layout: metadata.json says which rank file
holds which rows of which parameter, and `FragmentSource.rows(name, kind, start, stop)` cuts and joins
the overlapping fragments. Rank files are opened with `mmap=True`, so a rank touches only the pages of
the rows it asks for. Any world size and stage thus loads any other: the live engine's adapter says
which rows it holds (state.py) and gets exactly those.
[Note: verification] Before anything is read, the files are checked against manifest.json (size, then
sha256). The checking is spread over the ranks (file i on rank i mod M) and the first bad file is
agreed with one all-reduce, so every rank raises the same error naming the same file.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from . import format as fmt
from . import tensor_shards
from .state import rows_of

_OK = 2 ** 62


def resolve(load_dir, tag: str | None) -> Path | None:
    """The tag directory to load, or None (with a warning) when there is nothing to load."""
    load_dir = Path(load_dir)
    from_latest = tag is None
    if from_latest:
        tag = fmt.read_latest(load_dir)
        if tag is None:
            warnings.warn(f"no checkpoint to load: {load_dir / fmt.LATEST} does not exist; "
                          "pass tag= to load a specific one", stacklevel=3)
            return None
    path = fmt.tag_path(load_dir, str(tag), f"load_checkpoint({str(load_dir)!r}, tag={tag!r})")
    if from_latest and not path.is_dir():  # a lost checkpoint, not "nothing saved yet": auto_resume restarted at 0
        tags = ", ".join(fmt.committed_tags(load_dir)) or "none"
        raise fmt.CheckpointError(f"{load_dir / fmt.LATEST}: names tag {tag!r}, which is not in {load_dir} (tags "
                                  f"there: {tags}); pass tag= to load one of them, or delete {fmt.LATEST} to "
                                  "start afresh")
    if not path.is_dir():
        warnings.warn(f"no checkpoint to load: {path} does not exist", stacklevel=3)
        return None
    return path


def verify(path: Path, comm, manifest: dict) -> None:
    """Check every file of the manifest (spread over ranks); raise CheckpointError naming a bad one."""
    files = sorted(manifest["files"])
    first_bad, reason = _OK, None
    for i, name in enumerate(files):
        if i % comm.world_size != comm.rank:
            continue
        problem = fmt.check_file(path / name, manifest["files"][name])
        if problem is not None:
            first_bad, reason = i, problem
            break
    flag = comm.tensor([first_bad], dtype=torch.int64)  # once per load: a host copy is fine
    comm.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    bad = int(flag.item())
    if bad != _OK:
        why = reason if bad == first_bad else "sha256 or size does not match manifest.json (checked on another rank)"
        raise fmt.CheckpointError(f"checkpoint file {path / files[bad]}: {why}; load an earlier tag or re-save")


def load_torch(path: Path, mmap: bool = True):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise fmt.CheckpointError(f"checkpoint file {path}: missing") from None
    except Exception as e:  # noqa: BLE001 - a damaged zip, a refused global: name the file
        raise fmt.CheckpointError(f"checkpoint file {path}: cannot be read ({str(e).splitlines()[0]})") from None


class FragmentSource:
    """Rows of any parameter and kind from a checkpoint directory, via metadata.json's fragment table."""

    def __init__(self, path: Path, metadata: dict | None = None):
        self.path = path
        self.meta = metadata if metadata is not None else fmt.read_json(path / fmt.METADATA)
        if self.meta.get("format") != fmt.FORMAT_NAME:
            raise fmt.CheckpointError(f"{path / fmt.METADATA}: not a dstrain checkpoint")
        self.params: dict = self.meta["params"]
        self.dtypes = {name: fmt.dtype_named(entry["dtype"], f"{path / fmt.METADATA}: parameter {name!r}")
                       for name, entry in self.params.items()}  # an allow-list, never getattr(torch, ...)
        self._files: dict[int, dict] = {}
        self._joined_cache: tuple = (None, None, None)

    def _tensors(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = load_torch(self.path / fmt.rank_file(rank))["tensors"]
        return self._files[rank]

    def rank_extras(self, rank: int) -> dict:
        return load_torch(self.path / fmt.rank_file(rank))

    def kinds(self, name: str) -> dict:
        return self.params[name]["kinds"]

    def num_rows(self, name: str) -> int:
        shape = self.params[name]["shape"]
        return shape[0] if shape else 1

    def rows(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of `name`'s `kind`, joined from the fragments that overlap them."""
        entry, key = self.params[name], fmt.tensor_key(name, kind)
        if tensor_shards.KEY in entry:  # rows of the full tensor, from its shards (tensor_shards.py)
            return rows_of(self.full(name, kind))[start:stop]
        pieces = []
        for rank, fs, fe in entry["fragments"]:
            lo, hi = max(start, fs), min(stop, fe)
            if lo < hi:
                pieces.append(self._tensors(rank)[key][lo - fs:hi - fs])
        if not pieces:
            shape = entry["shape"][1:] if entry["shape"] else []
            dtype = self.dtypes[name] if kind == fmt.MODULE else torch.float32
            return torch.empty([0, *shape], dtype=dtype, device="cpu")  # like the mmap'ed fragments
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def copy_rows(self, name: str, kind: str, out: torch.Tensor) -> None:
        """Every row of `name`'s `kind` into `out` (its full shape, any dtype), piece by piece: no
        joined copy of the whole tensor first."""
        entry, key, dest = self.params[name], fmt.tensor_key(name, kind), rows_of(out)
        if tensor_shards.KEY in entry:
            dest.copy_(rows_of(self.full(name, kind)).reshape(dest.shape))
            return
        for rank, fs, fe in entry["fragments"]:
            dest[fs:fe].copy_(self._tensors(rank)[key].reshape(dest[fs:fe].shape))

    def scalar(self, name: str, kind: str):
        """A scalar state value (repeated in every fragment): the first fragment's."""
        rank = self.params[name]["fragments"][0][0]
        return self._tensors(rank)[fmt.tensor_key(name, kind)]

    def full(self, name: str, kind: str) -> torch.Tensor:
        """The whole tensor in its saved (full) shape."""
        entry = self.params[name]
        if tensor_shards.KEY in entry:
            return self._joined(name, kind)
        return self.rows(name, kind, 0, self.num_rows(name)).reshape(entry["shape"])

    def _joined(self, name: str, kind: str) -> torch.Tensor:
        """A tensor-parallel parameter's full tensor: each shard's rows in order, then the shards joined
        (tensor_shards.py's note). One parameter and kind are kept, since a loading rank asks for the
        same one several times (its weights, then its fp32 rows)."""
        if self._joined_cache[:2] == (name, kind):
            return self._joined_cache[2]
        entry, key = self.params[name], fmt.tensor_key(name, kind)
        layout = entry[tensor_shards.KEY]
        shape = tensor_shards.local_shape(entry["shape"], layout)
        by_shard: dict[int, list] = {i: [] for i in range(layout["degree"])}
        for rank, fs, fe, index in entry["fragments"]:
            by_shard[index].append((fs, fe, rank))
        shards = []
        for index, pieces in by_shard.items():
            pieces.sort()
            if [fs for fs, _, _ in pieces] != [0, *[fe for _, fe, _ in pieces[:-1]]] or pieces[-1][1] != shape[0]:
                raise fmt.CheckpointError(f"{self.path / fmt.METADATA}: the fragments of shard {index} of {name!r} do "
                                          "not cover its rows; the file is damaged or not written by dstrain")
            shards.append(torch.cat([self._tensors(rank)[key] for _, _, rank in pieces]).reshape(shape))
        full = tensor_shards.join_shards(shards, layout)
        self._joined_cache = (name, kind, full)
        return full

    def weights_kind(self, name: str) -> str:
        return fmt.FP32 if fmt.FP32 in self.kinds(name) else fmt.MODULE
