"""Checkpoint throughput against the disk, and the step-time cost of async saving.

    python benchmarks/bench_checkpoint.py [--mb 512] [--world 2] [--dir /tmp/dstrain-bench]

Measured in one run, on the same file system:
- disk: sequential write of a file of the checkpoint's size with O_DIRECT (no page cache; fsync), and
  a read of it after dropping it from the cache with posix_fadvise(DONTNEED);
- save: `engine.save_checkpoint` (ZeRO 2, fp32 AdamW: weights + exp_avg + exp_avg_sq = 3x the model),
  bytes written / wall time, hashing and fsync included; load: `engine.load_checkpoint` after the files
  were dropped from the page cache, bytes read / wall time, verification included;
- async: mean step time of a training loop with a save every N steps, async_save on vs off vs no saves.
Goal (issue 6): save and load >= 50% of disk bandwidth; async overhead <= 10% of step time.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import engine  # noqa: E402
from tests.harness import run_distributed  # noqa: E402


def disk_bandwidth(path: Path, nbytes: int, block: int = 16 << 20) -> tuple[float, float]:
    """(write GB/s with O_DIRECT + fsync, cold-cache read GB/s) of a file of `nbytes`."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for _ in range(max(1, nbytes // block)):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    write = max(1, nbytes // block) * block / (time.perf_counter() - t0) / 1e9
    read = _cold_read(path)
    path.unlink()
    return write, read


def _drop_cache(path: Path) -> None:
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _cold_read(path: Path) -> float:
    _drop_cache(path)
    t0, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            n += len(chunk)
    return n / (time.perf_counter() - t0) / 1e9


class Wide(torch.nn.Module):
    def __init__(self, numel: int, width: int = 4096):
        super().__init__()
        rows = max(1, numel // (4 * width))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(4))
        for layer in self.layers:
            layer.weight = torch.nn.Parameter(torch.randn(rows, width) * 0.01)
        self.width = width

    def forward(self, x):
        return sum((x @ layer.weight.t()).sum() for layer in self.layers) * 1e-6


def _config(root: str, async_save: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
            "checkpoint": {"async_save": async_save}}


def _io(root: str, numel: int) -> dict:
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Wide(numel), config=_config(root, False))
    eng.backward(eng(torch.randn(1, eng.module.width)))
    eng.step()  # optimizer state exists
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.save_checkpoint(root, tag="bench")
    save_s = time.perf_counter() - t0
    if eng.comm.rank == 0:
        _drop_cache(Path(root) / "bench")
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.load_checkpoint(root, tag="bench")
    torch.distributed.barrier()
    return {"save_s": save_s, "load_s": time.perf_counter() - t0}


def _steps(root: str, numel: int, mode: str, steps: int, every: int) -> float:
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Wide(numel), config=_config(root, mode == "async"))
    x = torch.randn(8, eng.module.width)
    times = []
    for i in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.backward(eng(x))
        eng.step()
        if mode != "none" and (i + 1) % every == 0:
            eng.save_checkpoint(root, tag=f"s{i}")
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    eng.wait_for_checkpoint()
    times[-1] += time.perf_counter() - t0  # the last save counts too
    return sum(times[1:]) / (len(times) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="model size in MB of fp32 weights")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dstrain-bench")
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--every", type=int, default=4)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    numel = args.mb * (1 << 20) // 4
    ckpt_bytes = 3 * numel * 4  # weights + exp_avg + exp_avg_sq (fp32)
    disk_w, disk_r = disk_bandwidth(root / "dd.bin", ckpt_bytes)
    io = run_distributed(_io, args.world, args=(str(root / "io"), numel), timeout=900)[0]
    step = {m: run_distributed(_steps, args.world, args=(str(root / m), numel, m, args.steps, args.every),
                               timeout=900)[0] for m in ("none", "sync", "async")}
    on_disk = sum(p.stat().st_size for p in (root / "io" / "bench").iterdir())
    report = {
        "checkpoint_GB": on_disk / 1e9, "world": args.world,
        "disk_write_GBps": disk_w, "disk_read_GBps": disk_r,
        "save_GBps": on_disk / io["save_s"] / 1e9, "load_GBps": on_disk / io["load_s"] / 1e9,
        "save_vs_disk": on_disk / io["save_s"] / 1e9 / disk_w, "load_vs_disk": on_disk / io["load_s"] / 1e9 / disk_r,
        "step_s": step, "async_overhead": step["async"] / step["none"] - 1, "sync_overhead": step["sync"] / step["none"] - 1,
    }
    print(json.dumps(report, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
