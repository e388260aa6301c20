"""Asynchronous file I/O for swap files, in plain Python threads (no compiled extension, no build step).

    io = AsyncFileIO(config.aio, path_key="zero_optimization.offload_optimizer.nvme_path")
    handle = io.write(path, tensor, offset)    # returns at once
    handle.wait()                              # raises OffloadIOError, one line, naming path and key

How each `aio` key is read here (DeepSpeed's meaning, mapped onto threads and vectored syscalls):
- `block_size`: bytes per request; a read or write is cut into requests of this size from its first
  4096-aligned byte on (so an unaligned transfer has one ragged head and tail, not one per request).
- `queue_depth` and `intra_op_parallelism`: requests in flight. DeepSpeed's aio handle runs
  `intra_op_parallelism` threads, each keeping `queue_depth` requests queued on the device; here the
  engine runs `intra_op_parallelism * queue_depth` worker threads, each carrying one blocking
  `os.preadv`/`os.pwritev` at a time (both release the GIL, so a step on the training thread overlaps
  the transfer). [Note: in flight] One thread with one syscall at a time keeps one request on the
  device whatever its size (the block layer merges a vectored syscall's contiguous buffers; this host's
  virtio disk takes 4 MiB per request). The 1.5-2.8x gains measured for this on 2026-12-07 were the
  benchmark's order, not the requests: its first section's pool came out on scattered 4 KiB pages
  (offload/pool.py's note: huge pages); with the pools on huge pages one request in flight and eight
  step the 25M GPT's rank share alike (207 / 207 and 244 / 305 ms, docs/offload_measurements.md).
- `single_submit`: false cuts an operation into up to that many runs of consecutive requests, one
  vectored syscall each (at most IOV_MAX buffers per call: DeepSpeed's batched `io_submit`, fewer
  syscalls for large transfers); true submits every request as a syscall of its own.
- `overlap_events`: true lets the requests of several outstanding operations run together; false runs
  operations one after another in submission order (each waits for the previous one to finish).
- `use_gds`: GPUDirect Storage is not built; true is refused here by name.

[Note: O_DIRECT] Swap files bypass the page cache (the bytes are read once per step; caching them
would only evict the training process's memory). O_DIRECT needs the buffer address, the file offset
and the length aligned to the device's logical block (4096 covers every device we know); `ALIGNMENT`
aligned requests go direct, any unaligned head, tail or buffer goes through a second, buffered
descriptor (Linux keeps the two coherent: direct I/O writes back and drops cached pages of its range).
A file system that refuses O_DIRECT (tmpfs on older kernels, some FUSE and network mounts) gets one
warning and buffered I/O. [Note: changed underneath] Every file remembers its inode and the bytes this
process wrote; a read of a file that was replaced, truncated or modified by someone else (mtime moved
while no write of ours was in flight) fails instead of handing back foreign bytes.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from offload import huge_pages

ALIGNMENT = 4096
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers per vectored call
AIO_KEYS = "aio.block_size / aio.queue_depth / aio.intra_op_parallelism"


class OffloadIOError(RuntimeError):
    """A swap-file read or write failed; the message is one line naming the path and the key to change."""


class OffloadIOWarning(UserWarning):
    pass


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass
class _FileRecord:
    """What this process knows about one swap file, to notice a file changed underneath it."""

    fd_direct: Optional[int]
    fd_buffered: int
    inode: tuple[int, int]
    written_end: int = 0
    writes_in_flight: int = 0
    mtime_ns: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class IOHandle:
    """The futures of one read or write; `wait()` returns the bytes moved or raises `OffloadIOError`."""

    def __init__(self, futures: list[Future], nbytes: int, on_done=None):
        self._futures, self.nbytes, self._on_done = futures, nbytes, on_done
        self._result: Optional[BaseException | int] = None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        if self._result is None:
            error = None
            for future in self._futures:
                exc = future.exception()
                if exc is not None and error is None:
                    error = exc
            if self._on_done is not None:
                self._on_done(error)
            self._result = error if error is not None else self.nbytes
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result


def wait_all(handles) -> int:
    """Wait for every handle, then raise the first error (else the bytes moved): one transfer failing
    leaves its siblings in flight, and a buffer may go back to its pool (and to the next reader) only
    once no worker reads or writes it any more."""
    moved, errors = 0, []
    for handle in handles:
        try:
            moved += handle.wait()
        except BaseException as err:  # noqa: BLE001 - raised below, once every transfer has landed
            errors.append(err)
    if errors:
        raise errors[0]
    return moved


def started(submissions) -> list:
    """The handles of `submissions` (an iterable that starts one transfer per item); when starting one
    raises (a file refused: changed underneath), those already started land before the error leaves,
    since the caller is about to give their buffers back (`wait_all`'s reason)."""
    handles = []
    try:
        for handle in submissions:
            handles.append(handle)
    except BaseException:
        with contextlib.suppress(Exception):
            wait_all(handles)
        raise
    return handles


class AsyncFileIO:
    """Reads and writes CPU tensors to files at byte offsets, in `block_size` requests on threads."""

    def __init__(self, aio, path_key: str):
        if getattr(aio, "use_gds", False):
            raise OffloadIOError("aio.use_gds: GPUDirect Storage is not built yet; remove it or use false")
        self.block_size, self.queue_depth = int(aio.block_size), int(aio.queue_depth)
        self.threads, self.single_submit = int(aio.intra_op_parallelism), bool(aio.single_submit)
        self.overlap_events, self.path_key = bool(aio.overlap_events), path_key
        if self.block_size % ALIGNMENT:
            raise OffloadIOError(f"aio.block_size is {self.block_size}: O_DIRECT needs a multiple of "
                                 f"{ALIGNMENT} bytes; set aio.block_size to e.g. 1048576")
        self.in_flight = self.threads * self.queue_depth  # worker threads (module note: in flight)
        self._pool = ThreadPoolExecutor(max_workers=self.in_flight, thread_name_prefix="dstrain-aio")
        self._files: dict[str, _FileRecord] = {}
        self._files_lock = threading.Lock()
        self._direct_ok: dict[str, bool] = {}  # directory -> O_DIRECT works there
        self._previous: list[Future] = []  # the last operation's futures (overlap_events false)

    # -- public -------------------------------------------------------------------------------
    def write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        record = self._record(path, create=True)
        view = _byte_view(tensor, path)
        with record.lock:
            record.writes_in_flight += 1

        def finished(error):
            with record.lock:
                record.writes_in_flight -= 1
                if error is None:
                    record.written_end = max(record.written_end, offset + len(view))
                if record.writes_in_flight == 0:
                    record.mtime_ns = os.fstat(record.fd_buffered).st_mtime_ns
        return self._submit(path, record, view, offset, write=True, on_done=finished)

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        record = self._record(path, create=False)
        view = _byte_view(tensor, path)
        self._check_unchanged(path, record, offset + len(view))
        return self._submit(path, record, view, offset, write=False, on_done=None)

    def discard(self, path: str, offset: int, nbytes: int) -> bool:
        """Give `nbytes` at `offset` of `path`, which nothing will read back, to the file system: a hole
        (the file keeps its size and its other offsets). Where the file system cannot, the bytes stay
        until the file is removed. False, having done nothing, while a lock it needs is held: a garbage
        collection inside this object's own critical section runs its caller (a finalizer, chunk_file.py),
        and waiting there would wait on this very thread."""
        if not self._files_lock.acquire(blocking=False):
            return False
        try:
            record = self._files.get(path)
        finally:
            self._files_lock.release()
        if record is None:
            return True
        if not record.lock.acquire(blocking=False):
            return False
        try:
            _punch_hole(record.fd_buffered, offset, nbytes)
            if record.writes_in_flight == 0:  # our own change, not another process's (_check_unchanged)
                record.mtime_ns = os.fstat(record.fd_buffered).st_mtime_ns
        finally:
            record.lock.release()
        return True

    def forget(self, path: str) -> None:
        """Close the descriptors of a file (before it is deleted)."""
        with self._files_lock:
            record = self._files.pop(path, None)
        if record is not None:
            for fd in (record.fd_direct, record.fd_buffered):
                if fd is not None:
                    os.close(fd)

    def delete(self, path: str) -> None:
        """Close a file's descriptors and delete it (one already gone is fine): a swap file's end."""
        self.forget(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for path in list(self._files):
            self.forget(path)

    # -- files --------------------------------------------------------------------------------
    def _record(self, path: str, create: bool) -> _FileRecord:
        with self._files_lock:
            record = self._files.get(path)
            if record is not None:
                return record
            if not create:
                raise OffloadIOError(f"{path}: swap file was never written by this process (or was removed "
                                     f"underneath it); keep {self.path_key} private to one job")
            flags = os.O_RDWR | os.O_CREAT
            try:
                fd_buffered = os.open(path, flags, 0o600)
            except OSError as err:
                raise self._error(err, path, "opening") from None
            fd_direct = None
            if self._supports_direct(os.path.dirname(path) or "."):
                fd_direct = os.open(path, flags | os.O_DIRECT, 0o600)
            st = os.fstat(fd_buffered)
            record = _FileRecord(fd_direct, fd_buffered, (st.st_dev, st.st_ino), mtime_ns=st.st_mtime_ns)
            self._files[path] = record
            return record

    def _supports_direct(self, directory: str) -> bool:
        known = self._direct_ok.get(directory)
        if known is not None:
            return known
        probe = os.path.join(directory, f".dstrain-odirect-probe-{os.getpid()}-{threading.get_ident()}")
        buf = aligned_empty(ALIGNMENT, torch.uint8)
        ok = False
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                ok = os.pwritev(fd, [memoryview(buf.numpy())], 0) == ALIGNMENT
            finally:
                os.close(fd)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise self._error(err, probe, "probing O_DIRECT in") from None
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        if not ok:
            warnings.warn(f"{directory}: the file system does not support O_DIRECT; swap files use buffered "
                          f"I/O there (slower, and the page cache holds their bytes); point {self.path_key} "
                          f"at a local NVMe file system for direct I/O", OffloadIOWarning, stacklevel=3)
        self._direct_ok[directory] = ok
        return ok

    def _check_unchanged(self, path: str, record: _FileRecord, end: int) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise OffloadIOError(f"{path}: swap file was removed while in use; keep {self.path_key} private "
                                 f"to one job") from None
        with record.lock:
            if (st.st_dev, st.st_ino) != record.inode:
                why = "replaced by another file"
            elif st.st_size < min(end, record.written_end):
                why = f"truncated to {st.st_size} bytes (this job wrote {record.written_end})"
            elif record.writes_in_flight == 0 and st.st_mtime_ns != record.mtime_ns:
                why = "modified by another process"
            else:
                return
        raise OffloadIOError(f"{path}: swap file was {why} while in use; its contents cannot be trusted; "
                             f"keep {self.path_key} private to one job")

    # -- requests -----------------------------------------------------------------------------
    def _submit(self, path, record, view: memoryview, offset: int, write: bool, on_done) -> IOHandle:
        total = len(view)
        wait_for = [] if self.overlap_events else list(self._previous)
        futures = [self._pool.submit(self._transfer, path, record, view[start:stop], offset + start, write, wait_for)
                   for start, stop in self._runs(offset, total)]
        if not futures:
            done: Future = Future()
            done.set_result(0)
            futures = [done]
        self._previous = futures
        return IOHandle(futures, total, on_done)

    def _runs(self, offset: int, total: int) -> list[tuple[int, int]]:
        """[start, stop) byte ranges of a transfer of `total` bytes at file `offset`, one per worker task:
        its `block_size` requests (the first also takes any ragged head before the first aligned byte,
        so every later one starts on the O_DIRECT block) one each with `single_submit`, else grouped into
        up to `in_flight` runs of consecutive requests."""
        cuts = [0]
        edge = round_up(offset) - offset + self.block_size  # requests start on the O_DIRECT block
        while edge < total:
            cuts.append(edge)
            edge += self.block_size
        cuts.append(total)
        blocks = len(cuts) - 1
        if not total:
            return []
        per_run = 1 if self.single_submit else -(-blocks // self.in_flight)
        edges = cuts[::per_run] + ([total] if (blocks % per_run) else [])
        return list(zip(edges[:-1], edges[1:]))

    def _transfer(self, path, record, view: memoryview, offset: int, write: bool, wait_for) -> int:
        for earlier in wait_for:  # overlap_events false: the previous operation first
            earlier.exception()
        moved = 0
        for fd, start, end in _segments(record, view, offset):
            moved += self._run_requests(path, fd, view[start:end], offset + start, write)
        return moved

    def _run_requests(self, path, fd, view: memoryview, offset: int, write: bool) -> int:
        """One run: its `block_size` requests in vectored syscalls of up to IOV_MAX buffers."""
        step = self.block_size * _IOV_MAX
        done = 0
        while done < len(view):
            chunk = view[done:done + step]
            buffers = [chunk[i:i + self.block_size] for i in range(0, len(chunk), self.block_size)]
            try:
                n = os.pwritev(fd, buffers, offset + done) if write else os.preadv(fd, buffers, offset + done)
            except OSError as err:
                raise self._error(err, path, "writing" if write else "reading") from None
            if n == 0 and write:
                raise OffloadIOError(f"{path}: the device accepted no bytes at offset {offset + done}; free "
                                     f"space there or point {self.path_key} at a larger device")
            if n == 0:
                raise OffloadIOError(f"{path}: short read at byte {offset + done} (file ends there, "
                                     f"{len(view) - done} bytes missing); the swap file was truncated; keep "
                                     f"{self.path_key} private to one job")
            done += n  # a partial transfer continues where it stopped
        return done

    def _error(self, err: OSError, path: str, doing: str) -> OffloadIOError:
        reason = os.strerror(err.errno) if err.errno else str(err)
        if err.errno == errno.ENOSPC or err.errno == errno.EDQUOT:
            fix = f"free space there or point {self.path_key} at a larger device"
        elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = f"make it writable by this user or point {self.path_key} at a writable directory"
        elif err.errno == errno.ENOENT:
            fix = f"create the directory or fix {self.path_key}"
        elif err.errno == errno.EINVAL:
            fix = f"the device refused an aligned request; check {AIO_KEYS}"
        else:
            fix = f"check {self.path_key} and {AIO_KEYS}"
        return OffloadIOError(f"{path}: {doing} swap file failed: {reason}; {fix}")


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Linux fallocate(PUNCH_HOLE | KEEP_SIZE); a failure (no such call, a file system without holes) is
    ignored: the bytes are only kept longer."""
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes)


def _segments(record: _FileRecord, view: memoryview, offset: int):
    """Split one transfer into (fd, start, end): the aligned middle direct, any ragged head/tail buffered."""
    n = len(view)
    if record.fd_direct is None or n == 0:
        return [(record.fd_buffered, 0, n)]
    address = _address(view)
    if (address - offset) % ALIGNMENT:  # buffer and file can never be aligned together
        return [(record.fd_buffered, 0, n)]
    head = min(n, (-offset) % ALIGNMENT)
    tail_start = head + (n - head) // ALIGNMENT * ALIGNMENT
    parts = [(record.fd_buffered, 0, head), (record.fd_direct, head, tail_start), (record.fd_buffered, tail_start, n)]
    return [p for p in parts if p[2] > p[1]]


def _address(view: memoryview) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else 0


def _byte_view(tensor: torch.Tensor, path: str) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise OffloadIOError(f"{path}: swap I/O needs a contiguous host tensor, got one on {tensor.device} "
                             f"(contiguous={tensor.is_contiguous()}); copy it to a pool buffer first")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """A host tensor of `numel` elements whose first byte is `ALIGNMENT`-aligned (O_DIRECT's rule); on
    huge pages where large enough (offload/huge_pages.py)."""
    return huge_pages.host_empty(numel, dtype, pin_memory, alignment=ALIGNMENT)
