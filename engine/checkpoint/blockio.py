"""Checkpoint file I/O at disk speed: large aligned blocks, hashing beside the I/O, not after it.

[Note: why] Measured (docs/checkpoints.md, Performance): writing through the page cache was throttled
to ~0.3 GB/s per rank by dirty-page writeback, sha256 (~1.5 GB/s on one core) ran serially after each
write, and verification at load read each file and hashed it in turn. Here:
- `HashingFile` gathers torch.save's writes into page-aligned blocks (`BLOCK`) and writes them with
  O_DIRECT where the file system allows it (no dirty pages to throttle or fsync; falls back to buffered
  writes where it does not, e.g. tmpfs). Full blocks go to two single-thread queues, one writing and
  one hashing, so the caller fills the next block while both run (os.write and hashlib release the
  GIL). Each queue is FIFO, so the hash is over the bytes in file order. The hash is of the same
  in-memory block that is written, as before ("hashed while written"). Blocks are reused from file to
  file (fresh ones page-fault).
- `file_digest` reads the next block in a thread while hashing the current one; the pages it reads
  stay cached, so the mmapped load that follows reads nothing from disk twice.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 8 << 20  # a multiple of every O_DIRECT alignment (512 B / 4 KiB)
ALIGN = 4096
NBUF = 3  # blocks in flight: one being filled, up to two being written and hashed
_POOL: list[mmap.mmap] = []  # blocks of closed files, reused: fresh ones page-fault (~20 ms of CPU per file here)
_POOL_LOCK = threading.Lock()


def _take_blocks() -> list[mmap.mmap]:
    with _POOL_LOCK:
        pooled, _POOL[:] = _POOL[:], []
    blocks = [b for b in pooled if len(b) == BLOCK][:NBUF]
    return blocks + [mmap.mmap(-1, BLOCK) for _ in range(NBUF - len(blocks))]  # page-aligned (O_DIRECT)


def _give_blocks(blocks: list[mmap.mmap]) -> None:
    with _POOL_LOCK:
        _POOL.extend(blocks[:max(0, NBUF - len(_POOL))])  # one file's worth is kept


def _open_direct(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:  # EINVAL: the file system has no O_DIRECT (tmpfs, some FUSE)
            pass
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class HashingFile:
    """A write-only file that hashes what passes through it (torch.save writes here) and can be told to
    kill its process half-way, for crash tests (writer.py's crash hook)."""

    def __init__(self, path: Path, kill_after: int | None = None):
        self.path = path
        self._fd, self._direct = _open_direct(path)
        self._hash = hashlib.sha256()
        self.size = 0
        self._kill_after = kill_after
        self._bufs = _take_blocks()
        self._pending: list = [None] * NBUF  # per buffer: its (write, hash) futures
        self._cur, self._fill = 0, 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self._kill_after is not None and self.size + n >= self._kill_after:
            self._drain()
            os.kill(os.getpid(), 9)  # the crash test's SIGKILL, mid-file
        while view:
            take = min(len(view), BLOCK - self._fill)
            self._bufs[self._cur][self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == BLOCK:
                self._submit_block()
        self.size += n
        return n

    def _submit_block(self) -> None:
        block = memoryview(self._bufs[self._cur])
        self._pending[self._cur] = (self._writer.submit(_write_all, self._fd, block),
                                    self._hasher.submit(self._hash.update, block))
        self._cur, self._fill = (self._cur + 1) % NBUF, 0
        self._wait(self._cur)  # the next buffer must be written and hashed before it is refilled

    def _wait(self, i: int) -> None:
        if self._pending[i] is not None:
            for fut in self._pending[i]:
                fut.result()
            self._pending[i] = None

    def _drain(self) -> None:
        for i in range(NBUF):
            self._wait((self._cur + 1 + i) % NBUF)

    def flush(self) -> None:
        pass  # blocks are written when full; close() writes the tail and fsyncs

    def close(self) -> dict:
        """Write the tail, fsync and close; returns the manifest entry."""
        try:
            self._drain()
            tail = memoryview(self._bufs[self._cur])[:self._fill]
            self._hash.update(tail)
            if self._direct:  # O_DIRECT writes whole aligned blocks: pad, then cut back to the size
                _write_all(self._fd, memoryview(self._bufs[self._cur])[:-(-self._fill // ALIGN) * ALIGN])
                os.ftruncate(self._fd, self.size)
            else:
                _write_all(self._fd, tail)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._writer.shutdown()
            self._hasher.shutdown()
            if all(p is None for p in self._pending):  # every block written and hashed: reusable
                _give_blocks(self._bufs)
            self._bufs = self._pending = []  # else unmapped once the futures' views are gone (no
            # close(): mmap refuses it while a memoryview of it exists)
        return {"sha256": self._hash.hexdigest(), "bytes": self.size}


def file_digest(path: Path, chunk: int = BLOCK) -> tuple[str, int]:
    """(sha256, size) of a file, reading block i+1 in a thread while hashing block i."""
    h, size = hashlib.sha256(), 0
    bufs = [bytearray(chunk), bytearray(chunk)]
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
        if hasattr(os, "posix_fadvise"):  # a larger kernel read-ahead window for one sequential pass
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        n, i = f.readinto(bufs[0]), 0
        while n:
            nxt = pool.submit(f.readinto, bufs[1 - i])
            h.update(memoryview(bufs[i])[:n])
            size += n
            n, i = nxt.result(), 1 - i
    return h.hexdigest(), size
