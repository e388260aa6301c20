"""A file-level snapshot of a swapped partition's state: its swap files copied, not read into memory.

An async checkpoint save (engine/checkpoint/nvme.py) must fix the state before the save returns, since
the next step overwrites the swap files (two slots: the step after next writes the slot the save would
read). Reading the state into host memory would cost the whole state; copying the files costs none:
`copy_file` asks the file system for a reflink (FICLONE: a copy-on-write clone, instant on btrfs, XFS
and others), else the kernel copies (`os.copy_file_range`: no user buffer), else it copies through one
bounded buffer. The copies live in the job's swap directory (offload/swap_dir.py), so a crash leaves
them where the swap files are and the next start removes them with the rest.
`FrozenState.rows(kind, a, b)` then reads elements [a, b) of one state kind back, one sub-group at a
time, for the background writer; `close()` deletes the copies.
"""
from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from offload.aio import OffloadIOError

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
COPY_CHUNK = 8 * 2**20  # bytes per copy_file_range call and per buffered copy


def _copy_range(src: int, dst: int, nbytes: int) -> None:
    copied = 0
    while copied < nbytes:
        n = os.copy_file_range(src, dst, min(COPY_CHUNK, nbytes - copied), copied, copied)
        if n == 0:
            raise OSError(f"copy_file_range stopped at byte {copied} of {nbytes}")
        copied += n


def _copy_buffered(src: int, dst: int, nbytes: int) -> None:
    copied = 0
    while copied < nbytes:
        data = os.pread(src, min(COPY_CHUNK, nbytes - copied), copied)
        if not data:
            raise OSError(f"short read at byte {copied} of {nbytes}")
        os.pwrite(dst, data, copied)
        copied += len(data)


def copy_file(src: str, dst: str, path_key: str) -> str:
    """Copy `src` to a new file `dst` without holding it in memory (module note); returns the way used
    ("reflink", "copy_file_range" or "buffered"). Errors are one line naming the path and `path_key`."""
    try:
        with open(src, "rb") as fin, open(dst, "xb") as fout:
            nbytes = os.fstat(fin.fileno()).st_size
            try:
                fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
                return "reflink"
            except OSError:
                pass  # no reflinks on this file system (ext4, tmpfs): the kernel copies instead
            try:
                _copy_range(fin.fileno(), fout.fileno(), nbytes)
                return "copy_file_range"
            except (AttributeError, OSError):
                os.ftruncate(fout.fileno(), 0)
                _copy_buffered(fin.fileno(), fout.fileno(), nbytes)
                return "buffered"
    except OSError as err:
        raise OffloadIOError(f"{dst}: cannot snapshot swap file {src} for an async checkpoint: "
                             f"{os.strerror(err.errno) if err.errno else err}; free space under {path_key} or "
                             "set checkpoint.async_save false") from None


def write_file(dst: str, pieces: Iterator[tuple[int, torch.Tensor]], path_key: str) -> None:
    """A new file `dst` holding each (byte offset, fp32 CPU tensor) of `pieces`: a state that is not in
    a swap file yet (fast_init's master before the first step) snapshotted from memory, piece by piece."""
    try:
        with open(dst, "xb") as f:
            for offset, t in pieces:
                os.pwrite(f.fileno(), t.detach().contiguous().view(torch.uint8).numpy().tobytes(), offset)
    except OSError as err:
        raise OffloadIOError(f"{dst}: cannot write an async checkpoint's snapshot: {os.strerror(err.errno)}; "
                             f"free space under {path_key} or set checkpoint.async_save false") from None


@dataclass
class FrozenState:
    """A swapped partition's state as of `SwappedPartition.frozen()`: per kind (the master and each
    state kind present) a file laid out as the swap files are, sub-group k at `k * stride_bytes`."""

    files: dict[str, str]
    groups: list[tuple[int, int]]
    stride_bytes: int
    scalars: dict = field(default_factory=dict)  # per-step scalars (Adam's step), equal in every sub-group

    @property
    def kinds(self) -> list[str]:
        return sorted(self.files)

    def rows(self, kind: str, a: int, b: int) -> Iterator[torch.Tensor]:
        """Elements [a, b) of `kind`, as fp32 CPU tensors of at most one sub-group each, in order."""
        with open(self.files[kind], "rb") as f:
            for k, (s, e) in enumerate(self.groups):
                lo, hi = max(a, s), min(b, e)
                if lo >= hi:
                    if s >= b:
                        return
                    continue
                out = torch.empty(hi - lo, dtype=torch.float32, device="cpu")
                f.seek(k * self.stride_bytes + (lo - s) * 4)
                if f.readinto(memoryview(out.numpy()).cast("B")) != out.numel() * 4:
                    raise OffloadIOError(f"{self.files[kind]}: the async checkpoint's snapshot is shorter than "
                                         "its sub-groups (removed or truncated while the save ran?)")
                yield out

    def close(self) -> None:
        """Delete the copies (after the checkpoint that reads them is committed, or failed)."""
        for path in self.files.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def snapshot_files(files: dict[str, str], path_for: Callable[[str], str], path_key: str) -> dict[str, str]:
    """Copy each kind's file to `path_for(kind)`; on an error the copies made so far are removed."""
    out: dict[str, str] = {}
    try:
        for kind, src in files.items():
            out[kind] = path_for(kind)
            copy_file(src, out[kind], path_key)
    except BaseException:
        FrozenState(out, [], 0).close()
        raise
    return out
