"""The NVMe optimizer step alone, under two or more `aio` sections, alternating step by step in one process.

    python benchmarks/bench_swapped_step.py [--aio '{"queue_depth": 1}' --aio '{}'] [--rounds 8] [--dir DIR]

One `SwappedPartition` per section over the same `--numel` fp32 elements (default: the 25M benchmark GPT's
rank share at ZeRO-3 on 2 ranks), as bench_offload.py's NVMe systems configure it: sub-groups of 1e6, 12
pool buffers, fused AdamW, pipelined reads and writes. Each round steps every partition once, in an order
that alternates, so a loaded machine's drift falls on all of them alike (the figures are still noisy: read
them paired). Per section, the median over rounds of: the step's wall and process CPU ms, the ms the
stepper waited for reads and for writes, the MiB read from and written to storage (/proc/self/io: the
swap files are O_DIRECT, so every byte is counted), and per I/O task (aio.py's runs) its median size and
latency. `{"queue_depth": 1}` is the engine's request pattern before 2026-12-07 for this step's 4 MiB
transfers (one syscall in flight); the default is DeepSpeed's section. A section's `"master_copy": true`
(not an aio key) steps with a host copy of the master, read instead of its file (swapped_partition.py's
note: master copy), as the engine does with the optimizer alone on NVMe. The final masters of all sections
must be equal bit for bit (the order of I/O changes no byte). `--ranks 2`: two processes step the same
section at the same time, as bench_offload.py's two ranks share the disk (rank 0's figures). First, the disk itself at the step's two
request patterns: raw O_DIRECT writes and reads of a 64 MiB file in 4 MiB requests one at a time and in
1 MiB requests eight at a time (threads; no fdatasync, as the step has none), best of 3, from buffers on
huge pages as the pools' are (offload/pool.py's note: huge pages; before 2026-12-07 every pool was on
4 KiB pages and the first section allocated stepped 2-5x slower than the others, whatever its section).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from offload import AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, sub_group_buffer_elements  # noqa: E402
from offload.aio import IOHandle  # noqa: E402
from schemas.features import AioConfig  # noqa: E402
from storage_io import io_counters  # noqa: E402

SUB_GROUP, BUFFERS = 1_000_000, 12


class Timings:
    """Waits per direction and I/O task latencies, collected by wrapping the engine and the stepper."""

    def __init__(self):
        self.waits, self.tasks = {"read": 0.0, "write": 0.0}, {"read": [], "write": []}
        run, start_read, finish = AsyncFileIO._run_requests, SwappedPartition._start_read, \
            SwappedPartition._finish_oldest_write
        timings = self

        def timed_run(io, path, fd, view, offset, write):
            t = time.perf_counter()
            n = run(io, path, fd, view, offset, write)
            timings.tasks["write" if write else "read"].append((n, time.perf_counter() - t))
            return n

        def timed_start_read(part, *args):
            buffers, handles = start_read(part, *args)
            return buffers, [_TimedRead(h, timings) for h in handles]

        def timed_finish(part):
            t = time.perf_counter()
            try:
                finish(part)
            finally:
                timings.waits["write"] += time.perf_counter() - t
        AsyncFileIO._run_requests, SwappedPartition._start_read = timed_run, timed_start_read
        SwappedPartition._finish_oldest_write = timed_finish

    def clear(self) -> None:
        self.waits.update(read=0.0, write=0.0)
        for v in self.tasks.values():
            v.clear()


class _TimedRead(IOHandle):
    def __init__(self, handle: IOHandle, timings: Timings):
        self._handle, self._timings = handle, timings

    def wait(self) -> int:
        t = time.perf_counter()
        try:
            return self._handle.wait()
        finally:
            self._timings.waits["read"] += time.perf_counter() - t


def raw_direct(path: str, request: int, in_flight: int, write: bool, nbytes: int = 64 << 20) -> float:
    """GB/s of O_DIRECT `request`-byte writes or reads of `nbytes` at `in_flight` threads, one at a time each."""
    pool = SwapBufferPool(max(in_flight, -(-32 * 2**20 // request)), request, torch.uint8, pin_memory=False)
    buffers = [memoryview(b.fill_(7).numpy()) for b in pool.buffers[:in_flight]]  # on huge pages, as the step's
    offsets = iter(range(0, nbytes, request))
    lock = threading.Lock()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)

    def work(buf) -> None:
        while True:
            with lock:
                at = next(offsets, None)
            if at is None:
                return
            assert (os.pwritev(fd, [buf], at) if write else os.preadv(fd, [buf], at)) == request
    try:
        threads = [threading.Thread(target=work, args=(b,)) for b in buffers]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return nbytes / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def disk_patterns(directory: str) -> None:
    path = os.path.join(directory, f"raw-{os.getpid()}.bin")
    try:
        for request, in_flight in ((4 << 20, 1), (1 << 20, 8)):
            best = {w: max(raw_direct(path, request, in_flight, w) for _ in range(3)) for w in (True, False)}
            print(f"disk, O_DIRECT {request >> 20} MiB x {in_flight} in flight: write {best[True]:.2f} GB/s, "
                  f"read {best[False]:.2f} GB/s")
    finally:
        os.unlink(path)


def _rounds(parts: list, copies: list, grad: torch.Tensor, rounds: int, timings: Timings, barrier) -> list[list]:
    """Per partition, per round: (wall ms, CPU ms, read wait ms, write wait ms, MiB read, MiB written,
    {direction: [(bytes, seconds)] per I/O task}). Every process starts each step at the barrier."""
    rows = [[] for _ in parts]
    for r in range(rounds):
        for i in (range(len(parts)) if r % 2 == 0 else reversed(range(len(parts)))):
            timings.clear()
            barrier.wait()
            (r0, w0), c0, t0 = io_counters(), time.process_time(), time.perf_counter()
            parts[i].step(lambda s, e: grad[s:e], *copies[i])
            t1, c1, (r1, w1) = time.perf_counter(), time.process_time(), io_counters()
            rows[i].append(((t1 - t0) * 1e3, (c1 - c0) * 1e3, timings.waits["read"] * 1e3,
                            timings.waits["write"] * 1e3, (r1 - r0) / 2**20, (w1 - w0) / 2**20,
                            {d: list(v) for d, v in timings.tasks.items()}))
    return rows


def _report(section: str, rows: list) -> None:
    med = [statistics.median(r[j] for r in rows) for j in range(6)]
    print(f"aio {section}: step {med[0]:.0f} ms (rounds {[round(r[0]) for r in rows]}), CPU {med[1]:.0f} ms, "
          f"waited for reads {med[2]:.0f} ms, for writes {med[3]:.0f} ms; read {med[4]:.1f} MiB, written "
          f"{med[5]:.1f} MiB per step")
    for d in ("read", "write"):
        tasks = [t for r in rows for t in r[6][d]]
        if tasks:
            print(f"  {d} tasks: {len(tasks) / len(rows):.0f} per step, median "
                  f"{statistics.median(t[0] for t in tasks) / 2**20:.2f} MiB in "
                  f"{statistics.median(t[1] for t in tasks) * 1e3:.1f} ms")


def _master_copy(master: torch.Tensor) -> tuple:
    """(on_updated, master_copy) over a host copy of the master, as the engine's TierMasterStore keeps it."""
    host = master.clone()
    return (lambda s, e, m: host[s:e].copy_(m)), (lambda s, e: host[s:e])


def _rank(rank: int, args, sections: list, directory: str, barrier) -> None:
    torch.set_num_threads(1)
    timings, numel = Timings(), int(args.numel)
    gen = torch.Generator().manual_seed(rank)
    master, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-3
    with SwapDir.create(directory, path_key="--dir") as swap:
        configs = [json.loads(s) for s in sections]
        copies = [_master_copy(master) if c.pop("master_copy", False) else () for c in configs]
        ios = [AsyncFileIO(AioConfig(**c), path_key="--dir") for c in configs]
        parts = []
        for i, io in enumerate(ios):
            pool = SwapBufferPool(BUFFERS, sub_group_buffer_elements(numel, SUB_GROUP), pin_memory=False)
            parts.append(SwappedPartition(numel, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), swap, io,
                                          pool, SUB_GROUP, pipeline_read=True, pipeline_write=True, name=f"s{i}"))
            parts[-1].initialize(lambda s, e: master[s:e])
            parts[-1].step(lambda s, e: grad[s:e], *copies[i])  # the first step creates the state: not measured
        rows = _rounds(parts, copies, grad, args.rounds, timings, barrier)
        equal = all(torch.equal(parts[0].read_master(s, e), part.read_master(s, e))
                    for part in parts[1:] for s, e in parts[0].groups)
        for part, io in zip(parts, ios):
            part.close()
            io.close()
    if rank == 0:
        for section, section_rows in zip(sections, rows):
            _report(section, section_rows)
        print(f"masters equal bit for bit: {equal}; load after {os.getloadavg()}")
    if not equal:
        raise SystemExit(f"rank {rank}: the sections' masters differ")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aio", action="append", help="an aio section as JSON (repeat; default: qd 1 and DeepSpeed's)")
    p.add_argument("--numel", type=float, default=12.6e6)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--ranks", type=int, default=1, help="processes stepping at once (a barrier per step), rank 0 reported")
    p.add_argument("--dir", default=None, help="where the swap files go (default: the temp directory)")
    args = p.parse_args(argv)
    sections, directory = args.aio or ['{"queue_depth": 1}', "{}"], args.dir or os.environ.get("TMPDIR", "/tmp")
    print(f"load before {os.getloadavg()}")
    disk_patterns(directory)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(args.ranks)
    procs = [ctx.Process(target=_rank, args=(r, args, sections, directory, barrier)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max(proc.exitcode for proc in procs) != 0


if __name__ == "__main__":
    sys.exit(main())
