"""Host tensors on transparent huge pages (2 MiB) for what the optimizer step streams through the CPU.

[Note: why huge pages] A step over a host partition (the offloaded step, and every ZeRO step on a
CPU-only machine) streams four arrays of the partition's size — master weights, gradient and two Adam
moments, 28 bytes per parameter — at a rate set by memory, not arithmetic. On 4 KiB pages each of
those streams crosses a page every 1,024 floats, 512 times as often as on 2 MiB pages; the TLB misses
and page walks that follow are the likely cost (read, not measured with counters). Measured on this
project's 2-core machine (torch's fused AdamW, 100M fp32 parameters, best step; README's CPU Adam
table): 0.118 s on 4 KiB pages, 0.104 s on huge pages at 1 thread; 0.062 against 0.053 s at 2
(benchmarks/bench_cpu_adam.py prints both rows). Most Linux distributions ship THP in
"madvise" mode, where only memory advised `MADV_HUGEPAGE` gets huge pages, and torch's allocator
advises only when `THP_MEM_ALLOC_ENABLE=1` is set before its first allocation — which a library cannot
arrange after `import torch`. So dstrain maps the large flats it allocates itself (`host_zeros`,
`host_empty`) and moves the optimizer state torch creates lazily on the first step (`adopt_state`).

Only host memory that is not pinned: page-locked memory belongs to the accelerator's allocator. Only
tensors of at least `MIN_BYTES`; only the whole 2 MiB pages inside the tensor are advised, so a tensor
holds no more resident memory than on 4 KiB pages (its tail stays on small pages). Where the kernel has
no THP (not Linux, or THP "never") these are plain torch tensors: the same values, the old speed.
Nothing here changes a value: a moved tensor is an exact copy. `DSTRAIN_HUGE_PAGES=0` turns it off.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) PMD size
# glibc serves every request above 32 MiB (the ceiling of its dynamic mmap threshold) from a fresh,
# untouched mapping, where advice given before the first write decides the page size. A smaller
# request may reuse heap memory already written (4 KiB pages that stay so): not worth advising.
MIN_BYTES = 32 << 20
_THP_SWITCH = "/sys/kernel/mm/transparent_hugepage/enabled"
_available: bool | None = None
_libc = None


def available() -> bool:
    """Whether this kernel gives advised anonymous memory huge pages (Linux, THP not "never"), and the
    user has not switched them off (`DSTRAIN_HUGE_PAGES=0`: for a kernel whose compaction stalls, or to
    measure their effect; read at each allocation)."""
    global _available
    if os.environ.get("DSTRAIN_HUGE_PAGES") == "0":
        return False
    if _available is None:
        _available = False
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                with open(_THP_SWITCH) as f:
                    _available = "[never]" not in f.read()
            except OSError:
                pass
    return _available


def eligible(nbytes: int, pin_memory: bool = False) -> bool:
    """Whether a host tensor of `nbytes` would be put on huge pages (module note)."""
    return not pin_memory and nbytes >= MIN_BYTES and available()


def host_empty(numel: int, dtype: torch.dtype = torch.float32, pin_memory: bool = False,
               alignment: int = 1) -> torch.Tensor:
    """An uninitialised host tensor of `numel` elements: on huge pages when eligible (module note), its
    first byte 2 MiB-aligned; else from `torch.empty` (pinned when asked), its first byte `alignment`-
    aligned (O_DIRECT's 4096: offload/aio.py's `aligned_empty`; 2 MiB covers that too)."""
    nbytes = numel * dtype.itemsize
    if eligible(nbytes, pin_memory):  # at this size a fresh mapping (MIN_BYTES), advised before anything writes it
        return advised_empty(nbytes).view(dtype)
    if alignment <= 1:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin_memory)
    return _aligned(nbytes, dtype, alignment, pin_memory)


def advised_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised host bytes (uint8), the first 2 MiB-aligned, its whole huge pages advised: from
    torch's allocator, so the storage behaves as any other (resize_(0) frees it: param_swap.py)."""
    out = _aligned(nbytes, torch.uint8, HUGE_PAGE, pin_memory=False)
    _advise(out.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return out


def _aligned(nbytes: int, dtype: torch.dtype, alignment: int, pin_memory: bool) -> torch.Tensor:
    """`nbytes` of a host allocation one `alignment` longer, from its first aligned byte (the unused
    head and tail are never written, so never resident)."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device="cpu", pin_memory=pin_memory)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip:skip + nbytes].view(dtype)


def _advise(address: int, length: int) -> None:
    """madvise(MADV_HUGEPAGE) on whole huge pages; a refusal (an old kernel) leaves small pages."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if length:
        _libc.madvise(address, length, mmap.MADV_HUGEPAGE)


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is (a view from the start of) what `host_empty` advised: 2 MiB-aligned, in a
    storage exactly one huge page longer than its bytes. A plain allocation of that shape would only
    be skipped by `adopt`: slower, never wrong."""
    nbytes = tensor.numel() * tensor.element_size()
    return (tensor.device.type == "cpu" and tensor.data_ptr() % HUGE_PAGE == 0
            and tensor.untyped_storage().nbytes() == nbytes + HUGE_PAGE)


def host_zeros(numel: int, dtype: torch.dtype = torch.float32, pin_memory: bool = False) -> torch.Tensor:
    """`host_empty`, zero-filled (the fill is the first touch: it faults the huge pages in)."""
    return host_empty(numel, dtype, pin_memory).zero_()


def adopt(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself, or an exact copy on huge pages when it is an eligible contiguous host tensor that
    is not on them already (one copy at memory bandwidth; the old storage is freed by the caller)."""
    # the size first: it rules out almost every tensor of a many-parameter stage-0 optimizer, per step
    if (tensor.numel() * tensor.element_size() < MIN_BYTES or tensor.device.type != "cpu"
            or not tensor.is_contiguous() or tensor.is_pinned() or not available() or on_huge_pages(tensor)):
        return tensor
    out = host_empty(tensor.numel(), tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def adopt_state(optimizer: torch.optim.Optimizer) -> int:
    """Move the large host tensors of `optimizer.state` onto huge pages, in place in the state dict; the
    number moved. For torch's own optimizers only, whose state dict is the only place that holds
    them (an optimizer of ours may keep a second reference, which a move would leave behind). Called
    after every step: it scans only when the state dict is new (load_state_dict replaces it) or has
    gained entries (lazy state), since torch's optimizers update their state tensors in place."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return 0
    seen = (id(optimizer.state), len(optimizer.state))
    if getattr(optimizer, "_dstrain_huge_pages_seen", None) == seen:
        return 0
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                new = adopt(value)
                if new is not value:
                    state[key] = new
                    moved += 1
    optimizer._dstrain_huge_pages_seen = seen
    return moved


def flat_zeros(numel: int, dtype: torch.dtype, device: torch.device | str,
               pin_memory: bool = False) -> torch.Tensor:
    """A zeroed 1-d flat on `device`: on a host, `host_zeros`; elsewhere `torch.zeros` there."""
    if torch.device(device).type == "cpu":
        return host_zeros(numel, dtype, pin_memory=pin_memory)
    return torch.zeros(numel, dtype=dtype, device=device)


def flat_empty(numel: int, dtype: torch.dtype, device: torch.device | str,
               pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-d flat on `device`: on a host, `host_empty`; elsewhere `torch.empty` there."""
    if torch.device(device).type == "cpu":
        return host_empty(numel, dtype, pin_memory=pin_memory)
    return torch.empty(numel, dtype=dtype, device=device)


def resident_huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages the kernel has mapped under `tensor`'s address range (/proc/self/smaps'
    AnonHugePages of the mappings it overlaps, at most their part inside it); 0 where there is no
    smaps. Whether advised memory gets huge pages at fault time is the kernel's call (free 2 MiB
    blocks, compaction): the benchmark reports this, the tests check `advised_bytes`."""
    return _smaps_bytes(tensor)[1]


def advised_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s address range in mappings advised for huge pages (smaps' VmFlags "hg")."""
    return _smaps_bytes(tensor)[0]


def _smaps_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    advised = huge = 0
    span = None  # the current mapping's part inside the tensor's range
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's header: "lo-hi perms offset ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    span = (max(lo, start), min(hi, end)) if lo < end and hi > start else None
                elif span is None:
                    continue
                elif head == "AnonHugePages:":
                    huge += min(int(line.split()[1]) * 1024, span[1] - span[0])
                elif head == "VmFlags:" and "hg" in line.split()[1:]:
                    advised += span[1] - span[0]
    except OSError:
        return 0, 0
    return advised, huge
