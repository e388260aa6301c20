"""Checkpoint throughput against the disk, and the step-time cost of async saving.

    python benchmarks/bench_checkpoint.py [--mb 256] [--world 2] [--dir /tmp/dstrain-bench]

Measured in one run, on the same file system (each figure the best of `--repeats`, other load on the
machine only ever adds time):
- disk: sequential write of a file of the checkpoint's size with O_DIRECT (no page cache; fsync), and
  a read of it after dropping it from the cache with posix_fadvise(DONTNEED);
- save: `engine.save_checkpoint` (ZeRO 2, fp32 AdamW: weights + exp_avg + exp_avg_sq = 3x the model),
  bytes written / wall time, hashing, fsync and commit included, after a first save (which also
  creates the checkpoint process group: `first_save_GBps`); load: `engine.load_checkpoint` after the
  files were dropped from the page cache, bytes read / wall time, verification included;
- step time with periodic saving (one engine, `--cycles` cycles after a warm-up one): each cycle runs
  one save interval (`--every` steps, as `checkpoint.save_interval` saves) without a save, one with a
  sync save, and one with an async save: the save at the interval's start, its `every` steps, and then
  whatever is left of the save (`wait_for_checkpoint`; in a run, the next save would wait for it).
  Each interval's wall time, saves included, divided by `every` is that cycle's step time per mode;
  overhead = step time / step time without saves - 1, per cycle, median over cycles (interleaving
  the modes keeps them under the same outside load). A cycle in which other processes took more than
  `--max-foreign` of the machine's CPU time (from /proc) is run again, at most 4 x `--cycles` times
  (`cycles_repeated`; `per_cycle_foreign_cpu` for the cycles kept). `save_blocking_s`: median time the
  training thread spends inside `save_checkpoint` (async: the snapshot), and for async the wait for the
  rest of the save after its interval's steps.
Goal (issue 6): save and load >= 50% of disk bandwidth; async overhead <= 10% of step time.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
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


def _config(async_save: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
            "checkpoint": {"async_save": async_save}}


def _io(root: str, numel: int, repeats: int) -> dict:
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Wide(numel), config=_config(False))
    rank0 = eng.comm.rank == 0
    eng.backward(eng(torch.randn(1, eng.module.width)))
    eng.step()  # optimizer state exists
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.save_checkpoint(root + "-first", tag="bench")  # a run's first save also sets up its process group
    out = {"first_save_s": time.perf_counter() - t0, "save_s": [], "load_s": []}
    for r in range(repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.save_checkpoint(root, tag=f"bench{r}")
        out["save_s"].append(time.perf_counter() - t0)
    for r in range(repeats):
        if rank0:
            _drop_cache(Path(root) / f"bench{repeats - 1}")
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.load_checkpoint(root, tag=f"bench{repeats - 1}")
        torch.distributed.barrier()
        out["load_s"].append(time.perf_counter() - t0)
    return out


def _cpu_jiffies(pids: list[int]) -> tuple[int, int, int]:
    """(all CPUs' jiffies, busy ones, those the processes `pids` used, all their threads)."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    ours = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ours += int(fields[11]) + int(fields[12])  # utime, stime
    return sum(cpu), sum(cpu) - cpu[3] - cpu[4], ours


def _set_async(eng, on: bool) -> None:
    ckpt = eng.checkpoint_io  # the engine's config is frozen: give its checkpointing a changed copy
    ckpt.cfg = ckpt.cfg.model_copy(update={"async_save": on})


def _steps(root: str, numel: int, every: int, cycles: int, max_foreign: float) -> dict:
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Wide(numel), config=_config(False))
    x = torch.randn(8, eng.module.width)
    pids = eng.comm.all_gather_object(os.getpid())

    def timed_steps() -> float:
        total = 0.0
        for _ in range(every):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            eng.backward(eng(x))
            eng.step()
            total += time.perf_counter() - t0
        return total

    def timed_save(tag: str) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.save_checkpoint(root, tag=tag)
        return time.perf_counter() - t0

    step = {"none": [], "sync": [], "async": []}
    blocking = {"sync": [], "async": [], "async_wait": []}
    foreign, repeated = [], 0
    cycle = 0
    while cycle <= cycles:  # cycle 0 warms up: first steps, first saves (process group, buffers)
        before = _cpu_jiffies(pids)
        _set_async(eng, False)
        none = timed_steps()
        sync = timed_steps()
        sync_save = timed_save(f"c{cycle}-sync")
        sync += sync_save
        _set_async(eng, True)
        async_save = timed_save(f"c{cycle}-async")
        asyn = async_save + timed_steps()
        t0 = time.perf_counter()
        eng.wait_for_checkpoint()  # the rest of the save (in a run, the next save waits for it)
        async_wait = time.perf_counter() - t0
        asyn += async_wait
        total, busy, ours = (b - a for a, b in zip(before, _cpu_jiffies(pids)))
        other = [(busy - ours) / max(1, total)]  # CPU share other processes took in this cycle
        torch.distributed.broadcast_object_list(other, src=0)
        if other[0] > max_foreign and repeated < 4 * cycles:
            repeated += 1  # the machine was busy with something else: this cycle does not count
            continue
        if cycle:
            foreign.append(other[0])
            for mode, t in (("none", none), ("sync", sync), ("async", asyn)):
                step[mode].append(t / every)
            blocking["sync"].append(sync_save)
            blocking["async"].append(async_save)
            blocking["async_wait"].append(async_wait)
        cycle += 1
    return {"step": step, "blocking": blocking, "foreign": foreign, "repeated": repeated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="model size in MB of fp32 weights")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dstrain-bench")
    ap.add_argument("--every", type=int, default=4, help="save interval in steps")
    ap.add_argument("--cycles", type=int, default=5, help="timed cycles of (no save, sync, async) intervals")
    ap.add_argument("--repeats", type=int, default=3, help="disk, save and load measurements (best kept)")
    ap.add_argument("--max-foreign", type=float, default=0.05,
                    help="repeat a cycle in which other processes took more than this share of the CPUs")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    numel = args.mb * (1 << 20) // 4
    ckpt_bytes = 3 * numel * 4  # weights + exp_avg + exp_avg_sq (fp32)
    disk = [disk_bandwidth(root / "dd.bin", ckpt_bytes) for _ in range(args.repeats)]
    disk_w, disk_r = max(d[0] for d in disk), max(d[1] for d in disk)
    io = run_distributed(_io, args.world, args=(str(root / "io"), numel, args.repeats), timeout=900)[0]
    on_disk = sum(p.stat().st_size for p in (root / "io" / f"bench{args.repeats - 1}").iterdir())
    shutil.rmtree(root / "io", ignore_errors=True)
    runs = run_distributed(_steps, args.world, args=(str(root / "steps"), numel, args.every, args.cycles,
                                                     args.max_foreign), timeout=3600)[0]
    step = {m: statistics.median(ts) for m, ts in runs["step"].items()}
    overhead = {m: statistics.median(t / n - 1 for t, n in zip(runs["step"][m], runs["step"]["none"]))
                for m in ("sync", "async")}
    save_GBps, load_GBps = on_disk / min(io["save_s"]) / 1e9, on_disk / min(io["load_s"]) / 1e9
    report = {
        "checkpoint_GB": on_disk / 1e9, "world": args.world,
        "disk_write_GBps": disk_w, "disk_read_GBps": disk_r,
        "save_GBps": save_GBps, "load_GBps": load_GBps, "first_save_GBps": on_disk / io["first_save_s"] / 1e9,
        "save_vs_disk": save_GBps / disk_w, "load_vs_disk": load_GBps / disk_r,
        "every": args.every, "step_s": step,
        "save_blocking_s": {m: statistics.median(b) for m, b in runs["blocking"].items()},
        "async_overhead": overhead["async"], "sync_overhead": overhead["sync"],
        "per_cycle_step_s": runs["step"],
        "per_cycle_foreign_cpu": runs["foreign"], "cycles_repeated": runs["repeated"],
    }
    print(json.dumps(report, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
