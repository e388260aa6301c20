"""Writing a checkpoint: snapshot on the training thread, files and atomic commit after.

[Note: atomic commit] Every rank writes its files into `<dir>/.<tag>.tmp-<nonce>/` (fsynced, hashed
while written). Then all ranks of the world exchange their files' sha256 and sizes (the exchange waits
for every process's files: placement.py's note, one committer); global rank 0 writes metadata.json and
manifest.json, renames the temp directory to `<dir>/<tag>` and only then replaces `latest` (temp file
+ os.replace); a final barrier returns no rank before the tag is visible. A crash anywhere before the
rename leaves a hidden temp directory that no reader looks at; a crash after it leaves a complete tag
(and `latest` still naming the previous one until it is replaced). The next save removes stale temp
directories.
[Note: async] With `checkpoint.async_save` the snapshot (a CPU copy of this rank's fragments; with
NVMe offload a copy of the swap files on disk instead, nvme.py's note) is taken on the training thread and everything else runs in one background thread, with its collectives
on a separate gloo process group, so they never interleave with training's collectives. At most one
save is in flight: the next save (and `wait()`) waits for it and re-raises its error. The background
thread and the write/hash threads it starts run at idle CPU priority (SCHED_IDLE): they use the CPU
time training leaves (its waits in collectives, other cores) rather than take a core from it; on a
machine with no time to spare the save takes longer, and the next save's wait shows it.
[Note: crash hook] `DSTRAIN_CKPT_TEST_CRASH=<rank>` makes that rank SIGKILL itself half-way through
writing its rank file: the tests' "kill -9 in the middle of a save".
"""
from __future__ import annotations

import os
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import Communicator
from . import format as fmt
from .streamed import save_streamed

CRASH_ENV = "DSTRAIN_CKPT_TEST_CRASH"


@dataclass
class Snapshot:
    """Everything one rank writes for one tag, detached from the live training state."""

    save_dir: Path
    tag: str
    nonce: str
    rank: int
    rank_content: dict
    metadata: dict | None = None  # rank 0 only
    engine_state: dict | None = None  # rank 0 only
    save_latest: bool = True
    keep_last: int | None = None
    nbytes: int = field(default=0)
    ready: object = None  # a CUDA event the arena copies finish at (snapshot.py's note: accelerators)
    streams: list = field(default_factory=list)  # placeholders written from swap files (streamed.py)
    release: object = None  # called once the files are written or failed: removes snapshot copies (nvme.py)


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


def _save_file(path: Path, obj, kill_after: int | None = None, streams: list | None = None) -> dict:
    f = fmt.HashingFile(path, kill_after)
    try:
        if streams:
            save_streamed(obj, f, streams)
        else:
            torch.save(obj, f)
    finally:
        entry = f.close()
    return entry


def _kill_after(snap: Snapshot) -> int | None:
    crash = os.environ.get(CRASH_ENV)
    if crash is None or int(crash) != snap.rank:
        return None
    return max(1, snap.nbytes // 2)


def write_and_commit(snap: Snapshot, comm: Communicator) -> None:
    """Write this rank's files, agree on the manifest, and (rank 0) commit. Collective over `comm`."""
    if snap.ready is not None:
        snap.ready.synchronize()
    tmp = fmt.tmp_dir(snap.save_dir, snap.tag, snap.nonce)
    entries, error = {}, None
    try:
        _write_files(snap, tmp, entries)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it (below), then it is raised
        error = e
    # [Note: failed writes] Each rank's outcome goes into the exchange, so a write that fails on one rank
    # fails the save on all: raised on that rank alone, the others waited here for it, and a job that
    # caught the error hung at its next collective. Nothing is committed; `latest` keeps the last tag.
    gathered = _agree(comm, snap, error, (entries,),
                      f"nothing was committed: {snap.save_dir / fmt.LATEST} names what it named before")
    error = None
    if snap.rank == 0:
        try:
            manifest = {name: entry for (per_rank,) in gathered for name, entry in per_rank.items()}
            manifest[fmt.METADATA] = fmt.write_json(tmp / fmt.METADATA, snap.metadata)
            fmt.write_json(tmp / fmt.MANIFEST, {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION,
                                                "files": manifest})
            fmt.fsync_dir(tmp)
            _commit(snap, tmp)
        except Exception as e:  # noqa: BLE001 - as above: every rank raises it
            error = e
    # also the final barrier: no rank returns before the tag is visible
    _agree(comm, snap, error, (), "its commit did not finish; the tags committed before are untouched")


def _agree(comm: Communicator, snap: Snapshot, error: BaseException | None, payload: tuple, after: str) -> list:
    """Exchange each rank's `payload` and outcome (note: failed writes); raise on every rank if one failed."""
    gathered = comm.all_gather_object((*payload, None if error is None else f"rank {snap.rank}: {error}"))
    failed = [item[-1] for item in gathered if item[-1] is not None]
    if failed:
        raise RuntimeError(f"checkpoint {snap.save_dir / snap.tag} not saved ({'; '.join(failed)}); {after}") from error
    return [item[:-1] for item in gathered]


def _write_files(snap: Snapshot, tmp: Path, entries: dict) -> None:
    """This rank's files into `tmp`, their manifest entries into `entries`."""
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        entries[fmt.rank_file(snap.rank)] = _save_file(tmp / fmt.rank_file(snap.rank), snap.rank_content,
                                                        _kill_after(snap), snap.streams)
    finally:
        if snap.release is not None:  # the rank file is the snapshot copies' only reader
            snap.release()
    if snap.rank == 0:
        entries[fmt.ENGINE_STATE] = _save_file(tmp / fmt.ENGINE_STATE, snap.engine_state)


def _commit(snap: Snapshot, tmp: Path) -> None:
    final = snap.save_dir / snap.tag
    if final.exists():  # saving a tag again replaces it; the old copy goes out of sight first
        aside = fmt.tmp_dir(snap.save_dir, snap.tag, "0ld" + snap.nonce)
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fmt.fsync_dir(snap.save_dir)
    if snap.save_latest:
        fmt.write_latest(snap.save_dir, snap.tag)
    prune(snap.save_dir, snap.keep_last)
    remove_stale_tmp(snap.save_dir)


def prune(save_dir: Path, keep_last: int | None) -> list[str]:
    """Delete the oldest committed tags beyond `keep_last` (never the one `latest` names)."""
    if not keep_last:
        return []
    tags, latest = fmt.committed_tags(save_dir), fmt.read_latest(save_dir)
    doomed = [t for t in tags[:max(0, len(tags) - keep_last)] if t != latest]
    for tag in doomed:  # hide first, then delete: a crash mid-delete leaves no half tag visible
        hidden = fmt.tmp_dir(save_dir, tag, "de1" + new_nonce())
        os.rename(save_dir / tag, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed


def remove_stale_tmp(save_dir: Path) -> None:
    for d in save_dir.iterdir():
        if d.is_dir() and fmt.is_tmp_dir(d):
            shutil.rmtree(d, ignore_errors=True)


def _idle_priority() -> None:
    """The calling thread, and the threads it starts (they inherit it), at idle CPU priority (Linux
    SCHED_IDLE; module note: async). Left as it is where that is not available or not allowed."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class CheckpointWriter:
    """Runs `write_and_commit` inline or in a background thread (module note: async)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._comm: Communicator | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def comm(self) -> Communicator:
        """A gloo group of its own, created on the first save (all ranks save together)."""
        if self._comm is None:
            group = dist.new_group(backend="gloo") if self.world_size > 1 else None
            self._comm = Communicator(group, device="cpu")  # objects only, over gloo
        return self._comm

    def submit(self, snap: Snapshot, background: bool) -> None:
        self.wait()
        comm = self.comm()
        if not background:
            write_and_commit(snap, comm)
            return
        self._thread = threading.Thread(target=self._run, args=(snap, comm), name="dstrain-ckpt", daemon=False)
        self._thread.start()

    def _run(self, snap: Snapshot, comm: Communicator) -> None:
        try:
            _idle_priority()
            write_and_commit(snap, comm)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by wait()
            self._error = e

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Wait for the save in flight, then destroy this writer's gloo group (`Engine.destroy`); the
        next save makes a new one."""
        self.wait()
        if self._comm is not None and self._comm.group is not None:
            dist.destroy_process_group(self._comm.group)
        self._comm = None

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error
