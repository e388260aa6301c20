"""Host memory handed back to the system when the NVMe parameter tier frees it (glibc's malloc).

[Note: heap retention] A process that swaps to NVMe promises host memory bounded by its pools, but
glibc's malloc keeps what it frees. Its mmap threshold is dynamic: each freed mmapped block raises
it to that block's size (up to 32 MiB), after which blocks of that size come from the heap, where a
freed one stays resident until everything above it is freed too. The tiers allocate and free
multi-MiB tensors all step (a gathered unit, its gradient, a bucket), so the heap grows to the
peak of several steps' interleaved lifetimes. Measured on the 265M ZeRO-Infinity GPT of
bench_infinity.py (2 ranks, 2 steps, RSS and `mallinfo2` sampled every 10 ms): the peak RSS above the
rank's start was 2120-2168 MiB while malloc's live bytes at that moment were 1566-1621 MiB; with the
threshold fixed at 256 KiB it was 1429-1435 MiB, against the estimator's 1373 MiB of model state.

`bound_heap_retention()` fixes the threshold with `mallopt(M_MMAP_THRESHOLD)`, which also turns the
dynamic adjustment (of the trim threshold too) off: blocks of 256 KiB or more get a mapping of their
own, returned on free (tests/test_offload_memory.py's ranks do the same, for the same reason). Called
once per process by the NVMe parameter tier (engine/zero/param_nvme.py: the store, where its partition
is larger than `offload_param.max_in_cpu`, and `zero.Init(remote_device="nvme")`'s chunk file), the
third note says why only there. The cost is a
fresh, zeroed mapping per large allocation. It changes
nothing where the user chose: glibc's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`
variables or a `glibc.malloc` tunable set, another allocator preloaded (jemalloc, tcmalloc, mimalloc),
or not glibc at all.
[Note: what the bound costs on a CPU-only machine] There the model's activations are host memory too,
so every activation of 256 KiB or more is a fresh mapping whose pages fault in on first touch. Measured
on the 25M benchmark GPT at ZeRO-3 with the optimizer on NVMe (2 ranks, rank 0's forward, 2026-12-06):
545-593 ms of CPU per forward against 405-449 ms with glibc's own threshold, and the same 25% on a run
without NVMe that fixes the threshold; the whole step 1859 ms against 2254-2491 ms
(benchmarks/results/2026-12-06-quiet-z3-nvme-mmap-threshold.txt). With an accelerator the activations
are device memory and only host tensors pay it. Trimming instead (glibc's threshold, `malloc_trim(0)`
after every step) does not bound the peak, which is inside backward: 2062-2129 MiB above the start on
the 265M GPT, against 1367-1429 with the fixed threshold and 2308 with neither
(2026-12-06-infinity-rss-heap-policies.txt). So the bound stays the default, outside the model's
forward (fourth note), and a user who would rather trade host memory for speed sets
`MALLOC_MMAP_THRESHOLD_` (say 33554432), which this leaves alone.
[Note: why the parameter tier] The churn the bound catches is stage 3's gathered units, their
gradients and buckets, which with parameters on NVMe pass through the host each step. With only the
optimizer on NVMe the bound bought little and cost the 25% above: the same 265M GPT with parameters in
memory (2 ranks, 3 runs each, 2026-12-06-heap-bound-optimizer-only.txt) peaked at 2213-3026 MiB above
the start with the threshold fixed against 2735-3355 with glibc's own (one run's ranks differ by up to
800 MiB either way), while with parameters on NVMe too it is 1392-1429 against 2230-2333. The optimizer
tier's own host memory is its fixed pool either way; a user who wants the heap bound there too sets
`MALLOC_MMAP_THRESHOLD_=262144`. Nor where `max_in_cpu` keeps the whole parameter partition resident:
the user gave host memory for it, the parameters no longer pass through the pool, and the bound's 25%
forward is what it would cost (the 25M GPT at ZeRO-3 with both tiers on NVMe and max_in_cpu 1e9, idle,
four rounds, 2026-12-06-quiet-z3-nvme-resident.txt: 1637-1781 ms per step against 1915-2078 with the
bound fixed in the ranks, rank 0's forward 448-479 against 568-597 ms; peak RSS per rank 1027-1108
against 928-929 MB). Why not give dstrain's own large host tensors mappings of their own and
leave glibc's threshold alone: tried with a switch in the ranks (707 `torch.empty`/`zeros` calls per rank
of engine/, offload/, ops/ on private mmaps), the 265M GPT's peak with parameters on NVMe fell only from
2362-2364 to 1978-2118 MiB above the start (fixed threshold: 1392-1429), the rest being tensors torch
allocates inside the ops and autograd (2026-12-06-infinity-rss-private-mappings.txt).
[Note: the forward in the heap] What the second note's cost is made of: the forward's activations, and
then backward's and the step's transients, each a fresh mapping. So while a stage-3 model's forward runs
(the coordinator's root pre- and post-forward hooks, engine/zero/prefetch.py: `forward_in_heap`) the
threshold is FORWARD_THRESHOLD, where glibc's dynamic one ends, and its blocks come from the heap, on
pages an earlier forward left there. The tier's own transients inside it (each gather's send, output
and full tensors, the parameter reads it starts: `tier_buffers`) keep mappings of their own: in the heap
they fragment it, and the whole forward in the heap cost 400-500 MiB more peak RSS on the 265M GPT
(+1837 / +1942 MiB above the start against +1402 / +1440 with the bound throughout, 2026-12-07). After
the forward the threshold is 256 KiB again, and glibc serves a large block from a free heap chunk that
fits before it maps one: backward and the step reuse what the activations leave free, and the heap grows
only inside a forward, by the forward's own blocks. The bound kept is then what is live plus the free
part of the heap the forward left: on the 265M GPT +1419-1475 / +1513 MiB above the start at the peak
(backward 1), against +1402 / +1440 with the bound throughout and +2308 with glibc's (2026-12-06); malloc
held above live there 65 / 87 MiB, and 102 MiB at the end (2 ranks, two runs, same host, 2026-12-07).
The 25M GPT (both tiers on NVMe, max_in_cpu 0, 2 ranks, paired A/B on a loaded host, 2026-12-07):
the forward's minor faults 26-46 thousand against 140 thousand with the bound throughout, its main-
thread CPU 1062-1279 against 1511-1665 ms, backward's 1925-2189 against 2713-2869 ms (faults 67-76
against 176 thousand), the step's faults 7-10 against 18 thousand; peak RSS per rank 868-884 against
832-838 MB (glibc's threshold at 32 MiB: 945-990) (benchmarks/results/2026-12-07-heap-forward-in-heap.txt).
A forward that raises is out of the heap at once too (the root's always-called forward hook, stage3_units.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform

MMAP_THRESHOLD = 256 << 10
# glibc's ceiling for the threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), which its dynamic threshold
# reaches: the forward's blocks are served as a process without the bound serves them (fourth note)
FORWARD_THRESHOLD = 32 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_done: bool | None = None
_mallopt = None  # libc's, once the thresholds are ours
_in_forward = False  # forward_in_heap's state


def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def bound_heap_retention() -> bool:
    """Fix glibc's mmap and trim thresholds (module note), once; True if this process's are now ours."""
    global _done, _mallopt
    if _done is None:
        chosen = any(os.environ.get(name) for name in _ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
        libc = None if chosen else _libc()
        _done = bool(libc) and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        _mallopt = libc.mallopt if _done else None
    return _done


def forward_in_heap(inside: bool) -> None:
    """A stage-3 forward begins (`inside`) or ends: while it runs, blocks below FORWARD_THRESHOLD come from
    the heap, and after it from the heap's free chunks or mappings of their own (fourth note). Nothing
    where the thresholds are not ours (the user's setting, another allocator, no bound asked for)."""
    global _in_forward
    if _mallopt is not None:
        _in_forward = inside
        _mallopt(_M_MMAP_THRESHOLD, FORWARD_THRESHOLD if inside else MMAP_THRESHOLD)


@contextlib.contextmanager
def tier_buffers():
    """The tier's own transients (a gather's send, output and full tensors, its reads): mappings of their
    own, returned on free, also inside the forward (fourth note: they would fragment its heap)."""
    if not _in_forward:
        yield
        return
    _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    try:
        yield
    finally:
        if _in_forward:
            _mallopt(_M_MMAP_THRESHOLD, FORWARD_THRESHOLD)
