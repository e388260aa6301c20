"""A per-job directory for swap files under `nvme_path`, removed when the job ends.

    with SwapDir.create(nvme_path, path_key="zero_optimization.offload_optimizer.nvme_path") as swap:
        path = swap.file("master.0.swp")

The directory is `<nvme_path>/dstrain-swap-<host>-<pid>-<n>` with `owner.json` recording the owner's
host, pid and process start time. It is removed by `close()`, by the context manager on an exception,
and at interpreter exit (atexit) otherwise. A job killed with SIGKILL leaves it behind, so `create`
first sweeps `nvme_path`: a directory whose owner on this host no longer runs (pid gone, or the pid was
reused by a process started at another time) is removed; a live job's directory, or one from another
host (a shared file system), is left alone.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import socket
import warnings
from pathlib import Path
from typing import Optional

import psutil

from offload.aio import OffloadIOError, OffloadIOWarning

PREFIX = "dstrain-swap-"
OWNER_FILE = "owner.json"
_counter = itertools.count()


def _start_time(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _owner_alive(owner: dict) -> bool:
    started = _start_time(int(owner["pid"]))
    return started is not None and abs(started - float(owner["start_time"])) < 1.0


def remove_stale(nvme_path: Path) -> list[Path]:
    """Remove swap directories under `nvme_path` whose owner on this host is gone; return them."""
    removed = []
    host = socket.gethostname()
    for entry in nvme_path.glob(PREFIX + "*"):
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
            if owner["host"] != host or _owner_alive(owner):
                continue
        except FileNotFoundError:
            continue  # its owner is between mkdir and writing owner.json; never taken for stale
        except (OSError, ValueError, KeyError, TypeError):
            warnings.warn(f"{entry}: unreadable {OWNER_FILE}; left alone (remove it by hand if no job uses it)",
                          OffloadIOWarning, stacklevel=2)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


class SwapDir:
    """One job's swap directory; `file(name)` gives paths inside it."""

    def __init__(self, path: Path):
        self.path = path
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def create(cls, nvme_path: str | os.PathLike, path_key: str) -> "SwapDir":
        root = Path(nvme_path)
        if not root.is_dir():
            raise OffloadIOError(f"{root}: swap directory does not exist; create it or fix {path_key}")
        if not os.access(root, os.W_OK | os.X_OK):
            raise OffloadIOError(f"{root}: swap directory is not writable by this user; fix its permissions "
                                 f"or point {path_key} at a writable directory")
        for entry in remove_stale(root):
            warnings.warn(f"removed stale swap directory {entry} (its job is no longer running)",
                          OffloadIOWarning, stacklevel=2)
        host, pid = socket.gethostname(), os.getpid()
        owner = {"host": host, "pid": pid, "start_time": _start_time(pid)}
        while True:
            path = root / f"{PREFIX}{host}-{pid}-{next(_counter)}"
            try:
                path.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
            except OSError as err:
                raise OffloadIOError(f"{path}: cannot create swap directory: {os.strerror(err.errno)}; fix "
                                     f"{path_key}") from None
        try:
            # Written aside and renamed: another rank of the job sweeping `nvme_path` at the same moment
            # (remove_stale) must see no owner.json or a whole one, never an empty file being written
            # (seen: "unreadable owner.json" warnings when two ranks started together).
            partial = path / f".{OWNER_FILE}.partial"
            partial.write_text(json.dumps(owner))
            os.replace(partial, path / OWNER_FILE)
        except OSError as err:
            shutil.rmtree(path, ignore_errors=True)
            raise OffloadIOError(f"{path}: cannot write {OWNER_FILE}: {os.strerror(err.errno)}; free space "
                                 f"there or point {path_key} at a larger device") from None
        return cls(path)

    def file(self, name: str) -> str:
        return str(self.path / name)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.path, ignore_errors=True)
            atexit.unregister(self.close)

    def __enter__(self) -> "SwapDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
