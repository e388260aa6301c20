"""Bytes a process has read from and written to storage (Linux /proc/self/io), for the benchmarks'
storage-per-step figures; imported by dstrain's ranks and DeepSpeed's peer alike (no torch).
O_DIRECT swap I/O always reaches the device, so these count every swap file's bytes; the counters
cover all the process's threads (DeepSpeed's async I/O threads included)."""
from __future__ import annotations


def io_counters() -> tuple[int, int]:
    """(read_bytes, write_bytes) of this process so far."""
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f)
    return int(io["read_bytes"]), int(io["write_bytes"])


def storage_bytes() -> int:
    """read_bytes + write_bytes of this process so far."""
    return sum(io_counters())
