"""The swap tier's file I/O (offload/aio.py), its buffer pool and its per-job directory.

- Bytes round-trip exactly at random sizes and byte offsets, aligned or not, under every `aio` shape
  (threads, batched or single submission, overlapped or serialised operations), many at once; on a
  file system without O_DIRECT (ramfs, mounted here) with one warning and buffered I/O.
- Disk full (a 1 MiB tmpfs mounted here, we run as root), a read-only or missing directory, a file
  denied to the user, a short read and a file replaced, truncated or modified underneath: each is one
  `OffloadIOError` line naming the path and the config key to change; no traceback text, no garbage.
- The job's swap directory is gone after a normal exit and after an exception; a SIGKILLed job's is
  removed at the next start; a live job's is left alone.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from offload import AsyncFileIO, OffloadIOError, SwapBufferPool, SwapDir
from offload.aio import ALIGNMENT, aligned_empty
from schemas.features import AioConfig

KEY = "zero_optimization.offload_optimizer.nvme_path"
ROOT = Path(__file__).resolve().parents[1]
SHAPES = [dict(), dict(block_size=4096, queue_depth=1, intra_op_parallelism=3),
          dict(block_size=8192, queue_depth=4, intra_op_parallelism=2, single_submit=True, overlap_events=False)]


@pytest.fixture
def io():
    engines = []

    def make(**aio):
        engines.append(AsyncFileIO(AioConfig(**aio), path_key=KEY))
        return engines[-1]
    yield make
    for engine in engines:
        engine.close()


@contextlib.contextmanager
def tmpfs(path: Path, options: str, fstype: str = "tmpfs"):
    path.mkdir(exist_ok=True)
    result = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(path)], capture_output=True, text=True)
    if result.returncode != 0:  # skip-free on purpose: the disk-full path must be exercised, not assumed
        pytest.fail(f"cannot mount a {fstype} for this test (needs root): {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def one_line(err: pytest.ExceptionInfo, *words: str) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)
    return text


@pytest.mark.parametrize("shape", SHAPES, ids=["default", "3threads-qd1", "single-serial"])
def test_random_sizes_and_offsets_round_trip(io, tmp_path, shape):
    engine = io(**shape)
    gen = torch.Generator().manual_seed(1)
    path = str(tmp_path / "swap.bin")
    written = {}
    for i in range(24):
        nbytes = int(torch.randint(1, 300_000, (1,), generator=gen))
        aligned = i % 2 == 0  # half go through aligned buffers at aligned offsets (the O_DIRECT path)
        offset = i * 400_000 + (0 if aligned else int(torch.randint(1, ALIGNMENT, (1,), generator=gen)))
        data = aligned_empty(nbytes, torch.uint8) if aligned else torch.empty(nbytes + 3, dtype=torch.uint8)[3:]
        data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        assert engine.write(path, data, offset).wait() == nbytes
        written[offset] = data.clone()
    for offset, data in written.items():
        back = torch.empty_like(data)
        engine.read(path, back, offset).wait()
        assert torch.equal(back, data), offset


def test_float_tensors_and_unaligned_lengths(io, tmp_path):
    engine = io(block_size=4096)
    path = str(tmp_path / "f.bin")
    for numel in (1, 1023, 1024, 1025, 100_003):
        src = aligned_empty(numel, torch.float32).normal_()
        engine.write(path, src, 0).wait()
        back = aligned_empty(numel, torch.float32)
        engine.read(path, back, 0).wait()
        assert torch.equal(back, src), numel


def test_file_system_without_o_direct_warns_once_and_falls_back(io, tmp_path):
    with tmpfs(tmp_path / "ram", "mode=0700", fstype="ramfs") as ram:  # ramfs refuses O_DIRECT
        engine = io(block_size=4096)
        with pytest.warns(UserWarning, match="does not support O_DIRECT") as caught:
            for name in ("a.bin", "b.bin"):
                src = aligned_empty(10_001, torch.float32).normal_()
                engine.write(str(ram / name), src, 4096).wait()
                back = torch.empty_like(src)
                engine.read(str(ram / name), back, 4096).wait()
                assert torch.equal(back, src)
                engine.forget(str(ram / name))
        assert sum("O_DIRECT" in str(w.message) for w in caught) == 1


def test_many_concurrent_requests(io, tmp_path):
    engine = io(block_size=4096, queue_depth=2, intra_op_parallelism=4)
    tensors = [aligned_empty(5000 + 97 * i, torch.float32).normal_() for i in range(64)]
    writes = [engine.write(str(tmp_path / f"{i % 4}.bin"), t, (i // 4) * 2**20) for i, t in enumerate(tensors)]
    for handle in writes:
        handle.wait()
    backs = [torch.empty_like(t) for t in tensors]
    reads = [engine.read(str(tmp_path / f"{i % 4}.bin"), b, (i // 4) * 2**20) for i, b in enumerate(backs)]
    for handle in reads:
        handle.wait()
    assert all(torch.equal(b, t) for b, t in zip(backs, tensors))


class SyscallLog:
    """`os.preadv`/`os.pwritev` wrapped (the real calls still move the bytes): (start, end, direction,
    offset, buffer sizes) per call and the most calls in progress at once. Each call holds until `expect`
    calls are in progress together (or HOLD_S pass), so requests meant to be in flight together are seen
    together however late the scheduler starts the last worker thread (a fixed sleep raced it under load);
    an engine with fewer in flight never gets there, and `most` stays below `expect`."""

    HOLD_S = 2.0

    def __init__(self, monkeypatch):
        self.calls, self.now, self.most, self.expect = [], 0, 0, 0
        self._cond = threading.Condition()
        for name, direction in (("preadv", "read"), ("pwritev", "write")):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name), direction))

    def expecting(self, count: int) -> "SyscallLog":
        """Starts a new measurement whose calls hold until `count` are in progress."""
        self.calls.clear()
        self.most, self.expect = 0, count
        return self

    def _wrap(self, real, direction):
        def call(fd, buffers, offset):
            with self._cond:
                self.now += 1
                self.most = max(self.most, self.now)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self.now >= self.expect, timeout=self.HOLD_S)
            start = time.perf_counter()
            try:
                return real(fd, buffers, offset)
            finally:
                with self._cond:
                    self.now -= 1
                    self.calls.append((start, time.perf_counter(), direction, offset, [len(b) for b in buffers]))
        return call


MIB = 1 << 20


def opened(engine, *paths):
    """Open the files first (the O_DIRECT probe's own write stays out of the log)."""
    for path in paths:
        engine.write(str(path), torch.empty(0, dtype=torch.uint8), 0).wait()


def test_queue_depth_requests_in_flight(io, tmp_path, monkeypatch):
    """DeepSpeed's default section (1 MiB blocks, queue depth 8, 1 thread) keeps 8 requests on the device
    (aio.py's note: in flight); the engine carried one syscall at a time until 2026-12-07."""
    engine = io()
    src = aligned_empty(8 * MIB, torch.uint8).random_(0, 256)
    path = str(tmp_path / "q.bin")
    opened(engine, path)
    log = SyscallLog(monkeypatch).expecting(8)
    engine.write(path, src, 0).wait()
    assert log.most == 8 and len(log.calls) == 8
    assert sorted(c[3] for c in log.calls) == [i * MIB for i in range(8)]  # block_size requests, at block offsets
    log.expecting(4)
    back = aligned_empty(4 * MIB, torch.uint8)
    engine.read(path, back, 4 * MIB).wait()  # a sub-group's tensor of the 25M GPT's step: four in flight
    assert log.most == 4 and torch.equal(back, src[4 * MIB:])


def test_threads_times_queue_depth_batched_or_single(io, tmp_path, monkeypatch):
    """`intra_op_parallelism` x `queue_depth` syscalls in flight; batched (single_submit false) each carries a
    run of consecutive block-sized buffers, single one block. A transfer at an unaligned offset is cut into
    blocks from its first aligned byte on, so only its first and last requests are ragged."""
    batched, single = io(block_size=8192, queue_depth=2, intra_op_parallelism=2), \
        io(block_size=8192, queue_depth=2, intra_op_parallelism=2, single_submit=True)
    src = aligned_empty(64 * 8192, torch.uint8).random_(0, 256)
    opened(batched, tmp_path / "b.bin")
    opened(single, tmp_path / "s.bin")
    log = SyscallLog(monkeypatch).expecting(4)
    batched.write(str(tmp_path / "b.bin"), src, 0).wait()
    assert log.most == 4 and len(log.calls) == 4 and all(c[4] == [8192] * 16 for c in log.calls)
    log.expecting(4)
    single.write(str(tmp_path / "s.bin"), src[:16 * 8192], 0).wait()
    assert log.most == 4 and len(log.calls) == 16 and all(c[4] == [8192] for c in log.calls)
    log.expecting(0)
    data = torch.empty(3 * 8192 + 11, dtype=torch.uint8).random_(0, 256)  # unaligned: the buffered descriptor
    single.write(str(tmp_path / "s.bin"), data, 5000).wait()
    assert sorted(c[3] for c in log.calls) == [5000, 16384, 24576]  # 3192 ragged bytes + a block, a block, the rest
    back = torch.empty_like(data)
    single.read(str(tmp_path / "s.bin"), back, 5000).wait()
    assert torch.equal(back, data)


def test_overlap_events_false_runs_operations_in_order(io, tmp_path, monkeypatch):
    engine = io(overlap_events=False)
    a, b = (aligned_empty(2 * MIB, torch.uint8).random_(0, 256) for _ in range(2))
    overlapped = io()
    opened(engine, tmp_path / "a.bin", tmp_path / "b.bin")
    opened(overlapped, tmp_path / "0.bin", tmp_path / "1.bin")
    log = SyscallLog(monkeypatch).expecting(2)
    first, second = engine.write(str(tmp_path / "a.bin"), a, 0), engine.write(str(tmp_path / "b.bin"), b, 0)
    second.wait()
    first.wait()
    calls = sorted(log.calls)
    assert log.most == 2  # each operation's two requests together, the operations one after the other
    assert max(c[1] for c in calls[:2]) <= min(c[0] for c in calls[2:])
    log.expecting(4)
    handles = [overlapped.write(str(tmp_path / f"{i}.bin"), t, 0) for i, t in enumerate((a, b))]
    for handle in handles:
        handle.wait()
    assert log.most == 4


def test_disk_full_is_one_clear_line(io, tmp_path):
    with tmpfs(tmp_path / "small", "size=1m") as small:
        engine = io(block_size=65536)
        with pytest.raises(OffloadIOError) as err:
            engine.write(str(small / "big.bin"), aligned_empty(2 * 2**20, torch.uint8), 0).wait()
        one_line(err, str(small / "big.bin"), "No space left", KEY)
        engine.forget(str(small / "big.bin"))


def test_read_only_and_missing_directories(io, tmp_path):
    with pytest.raises(OffloadIOError) as err:
        SwapDir.create(tmp_path / "nope", path_key=KEY)
    one_line(err, str(tmp_path / "nope"), "does not exist", KEY)
    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        with pytest.raises(OffloadIOError) as err:
            SwapDir.create(ro, path_key=KEY)
        one_line(err, str(ro), "not writable", KEY)
        with pytest.raises(OffloadIOError) as err:
            io().write(str(ro / "x.bin"), torch.zeros(10), 0)
        one_line(err, str(ro / "x.bin"), "Read-only file system", KEY)


def test_permission_denied_for_another_user(tmp_path):
    """Root ignores mode bits, so the denied user is `nobody`: a child that drops to it after its imports."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        import torch
        from offload import AsyncFileIO, OffloadIOError
        from schemas.features import AioConfig
        import os; os.setgid(65534); os.setuid(65534)
        try:
            AsyncFileIO(AioConfig(), path_key={KEY!r}).write({str(private / 'x.bin')!r}, torch.zeros(4), 0)
        except OffloadIOError as err:
            print(err)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Permission denied" in result.stdout and KEY in result.stdout and str(private) in result.stdout, result.stdout


def test_short_read_and_files_changed_underneath(io, tmp_path):
    engine = io(block_size=4096)
    path = str(tmp_path / "s.bin")
    engine.write(path, aligned_empty(8192, torch.uint8).fill_(7), 0).wait()
    with pytest.raises(OffloadIOError) as err:
        engine.read(path, aligned_empty(12288, torch.uint8), 0).wait()
    one_line(err, path, "short read", KEY)

    os.truncate(path, 4096)
    with pytest.raises(OffloadIOError) as err:
        engine.read(path, aligned_empty(8192, torch.uint8), 0)
    one_line(err, path, "truncated", KEY)

    engine.write(path, aligned_empty(8192, torch.uint8).fill_(1), 0).wait()
    time.sleep(0.01)  # not a timing assertion: lets the foreign write get a later mtime than ours
    with open(path, "r+b") as f:
        f.write(b"foreign")
    with pytest.raises(OffloadIOError) as err:
        engine.read(path, aligned_empty(8192, torch.uint8), 0)
    one_line(err, path, "modified by another process", KEY)

    other = tmp_path / "other.bin"
    other.write_bytes(bytes(8192))
    os.replace(other, path)
    with pytest.raises(OffloadIOError) as err:
        engine.read(path, aligned_empty(8192, torch.uint8), 0)
    one_line(err, path, "replaced", KEY)


def test_unaligned_block_size_and_gds_are_refused():
    with pytest.raises(OffloadIOError, match="aio.block_size"):
        AsyncFileIO(AioConfig(block_size=1000), path_key=KEY)
    with pytest.raises(OffloadIOError, match="aio.use_gds"):
        AsyncFileIO(AioConfig(use_gds=True), path_key=KEY)


def test_pool_blocks_until_a_buffer_is_released():
    pool = SwapBufferPool(2, 1000, pin_memory=True)
    assert all(b.data_ptr() % ALIGNMENT == 0 and b.device.type == "cpu" for b in pool._buffers)
    a, b = pool.acquire(), pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # blocked: both buffers are out
    pool.release(a)
    waiter.join(60)
    assert got and got[0].data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="already free"):
        pool.release(b) or pool.release(b)


# -- the per-job swap directory ---------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from offload import SwapDir
    swap = SwapDir.create({nvme!r}, path_key="k")
    open(swap.file("master.0.swp"), "wb").write(b"x" * 4096)
    print(swap.path, flush=True)
    {then}
""")


def _child(nvme: Path, then: str) -> subprocess.Popen:
    code = CHILD.format(root=str(ROOT), nvme=str(nvme), then=then)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _swap_dirs(nvme: Path) -> list[Path]:
    return sorted(nvme.glob("dstrain-swap-*"))


def test_swap_dir_removed_at_normal_exit_and_at_an_exception(tmp_path):
    # both children at once (each imports torch): their own nvme_path each, so each check is its own
    children = {then: (tmp_path / name, _child_in(tmp_path / name, then))
                for name, then in (("normal-exit", "pass"), ("exception", "raise RuntimeError('boom')"))}
    for then, (nvme, child) in children.items():
        out, err = child.communicate(timeout=120)
        assert Path(out.strip()).parent == nvme, err
        assert child.returncode == (0 if then == "pass" else 1), err
        assert _swap_dirs(nvme) == []


def _child_in(nvme: Path, then: str) -> subprocess.Popen:
    nvme.mkdir()
    return _child(nvme, then)


def test_killed_jobs_dir_removed_at_next_start_live_jobs_kept(tmp_path):
    killed, live = _child(tmp_path, "time.sleep(600)"), _child(tmp_path, "time.sleep(600)")
    try:
        killed_dir, live_dir = Path(killed.stdout.readline().strip()), Path(live.stdout.readline().strip())
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(60)
        assert killed_dir.is_dir()  # SIGKILL ran no cleanup
        with pytest.warns(UserWarning, match="removed stale swap directory"):
            mine = SwapDir.create(tmp_path, path_key=KEY)
        assert not killed_dir.exists() and live_dir.is_dir() and mine.path.is_dir()
        mine.close()
        assert _swap_dirs(tmp_path) == [live_dir]
    finally:
        for child in (killed, live):
            if child.poll() is None:
                child.kill()
            child.wait(60)
