"""NVMe swap throughput: the offload I/O engine against the disk's O_DIRECT bandwidth, in one run.

    python benchmarks/bench_offload_io.py [--mb 256] [--dir /tmp/dstrain-bench] [--repeats 3] [--threads 1,2]

- disk: a plain loop of O_DIRECT `os.pwrite`/`os.pread` calls of `aio.block_size` bytes, one thread,
  over a `--mb` file (what a single submitter gets from the device, no page cache);
- engine: `offload.AsyncFileIO` writing and reading one `--mb` tensor (an aligned pool-like buffer)
  with DeepSpeed's default `aio` section and `intra_op_parallelism` from `--threads`.
- init: `offload_optimizer.fast_init` off and on, a `SwappedPartition` of `--mb` of fp32 master
  (fused AdamW, sub-groups of 16Mi elements, 12 buffers, pipelined reads and writes): `initialize()` (off: the
  master written to the swap file; on: nothing) and the first `step()` after it, swap files fsynced.
Each figure is the best of `--repeats` (other load only ever adds time); each write ends with
fdatasync, each read starts after posix_fadvise(DONTNEED). Goal (issue 17): engine >= 70% of disk
both ways. Prints one JSON object; record `uptime` before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from offload import (AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, aligned_empty,  # noqa: E402
                     sub_group_buffer_elements)
from schemas.features import AioConfig  # noqa: E402


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_direct(path: str, buf: torch.Tensor, block: int, write: bool) -> float:
    view = memoryview(buf.numpy()).cast("B")
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o600)
    try:
        start = time.perf_counter()
        for off in range(0, len(view), block):
            chunk = view[off:off + block]
            n = os.pwrite(fd, chunk, off) if write else os.preadv(fd, [chunk], off)
            assert n == len(chunk)
        if write:
            os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def random_aligned(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random aligned buffer of `nbytes` to write and an aligned one to read back into."""
    buf = aligned_empty(nbytes, torch.uint8)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return buf, aligned_empty(nbytes, torch.uint8)


def disk_bandwidth(d: str, nbytes: int, repeats: int, block: int = AioConfig().block_size,
                   buffers: tuple | None = None) -> tuple[float, float]:
    """(write, read) GB/s of the raw O_DIRECT loop over an `nbytes` file in `d`, best of `repeats` (the
    figure bench_offload.py and bench_infinity.py set the gradient swap's bytes against)."""
    buf, back = buffers or random_aligned(nbytes)
    raw = os.path.join(d, "raw.bin")
    best_w, best_r = float("inf"), float("inf")
    try:
        for _ in range(repeats):
            best_w = min(best_w, raw_direct(raw, buf, block, write=True))
            _drop_cache(raw)
            best_r = min(best_r, raw_direct(raw, back, block, write=False))
    finally:
        if os.path.exists(raw):
            os.unlink(raw)
    return nbytes / best_w / 1e9, nbytes / best_r / 1e9


def engine_io(io: AsyncFileIO, path: str, buf: torch.Tensor, write: bool) -> float:
    start = time.perf_counter()
    (io.write if write else io.read)(path, buf, 0).wait()
    if write:
        os.fdatasync(io._files[path].fd_buffered)
    return time.perf_counter() - start


def _fsync_dir(swap: SwapDir) -> None:
    for f in swap.path.glob("*.swp"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def initialisation(d: str, nbytes: int, deferred: bool) -> dict:
    """Seconds of initialize() and of the first step, fast_init off or on (module note: init)."""
    numel, sub_group = nbytes // 4, 1 << 24  # sub-groups of 64 MiB: the 12 pool buffers are 768 MiB at most
    master = torch.randn(numel, device="cpu")
    grad = torch.randn(numel, device="cpu")
    with SwapDir.create(d, path_key="--dir") as swap:
        io = AsyncFileIO(AioConfig(intra_op_parallelism=2), path_key="--dir")
        pool = SwapBufferPool(12, sub_group_buffer_elements(numel, sub_group), pin_memory=False)
        part = SwappedPartition(numel, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), swap, io, pool,
                                sub_group, pipeline_read=True, pipeline_write=True)
        start = time.perf_counter()
        part.initialize(lambda s, e: master[s:e], deferred=deferred)
        _fsync_dir(swap)
        init_s = time.perf_counter() - start
        start = time.perf_counter()
        part.step(lambda s, e: grad[s:e], lambda s, e, m: master[s:e].copy_(m))
        _fsync_dir(swap)
        step_s = time.perf_counter() - start
        part.close()
        io.close()
    return {"init_s": init_s, "first_step_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--dir", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2")
    args = p.parse_args()
    nbytes = args.mb * 2**20
    aio = AioConfig()
    buf, back = random_aligned(nbytes)
    result = {"mb": args.mb, "block_size": aio.block_size, "queue_depth": aio.queue_depth, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        result["disk_write_GBps"], result["disk_read_GBps"] = disk_bandwidth(d, nbytes, args.repeats, aio.block_size,
                                                                            (buf, back))
        for threads in (int(t) for t in args.threads.split(",")):
            io = AsyncFileIO(AioConfig(intra_op_parallelism=threads), path_key="--dir")
            path = os.path.join(d, f"engine{threads}.bin")
            best_w, best_r = float("inf"), float("inf")
            for _ in range(args.repeats):
                best_w = min(best_w, engine_io(io, path, buf, write=True))
                _drop_cache(path)
                back.zero_()
                best_r = min(best_r, engine_io(io, path, back, write=False))
                assert torch.equal(back, buf)
            io.close()
            w, r = nbytes / best_w / 1e9, nbytes / best_r / 1e9
            result[f"engine_t{threads}"] = {"write_GBps": w, "read_GBps": r,
                                            "write_vs_disk": w / result["disk_write_GBps"],
                                            "read_vs_disk": r / result["disk_read_GBps"]}
        for name, deferred in (("fast_init_off", False), ("fast_init_on", True)):
            runs = [initialisation(d, nbytes, deferred) for _ in range(args.repeats)]
            result[name] = {k: min(r[k] for r in runs) for k in ("init_s", "first_step_s")}
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
