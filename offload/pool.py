"""`SwapBufferPool`: a fixed set of aligned host buffers that swap I/O goes through.

Every swap read and write uses one of `buffer_count` buffers of `buffer_size` elements, so the host
memory used for swapping is `buffer_count * buffer_size * itemsize` bytes, whatever is swapped.
`acquire()` blocks until a buffer is free (a finished write gives its buffer back), which is what keeps
a pipelined stepper within that bound. Buffers are page-aligned (O_DIRECT, see offload/aio.py) and
pinned when an accelerator is present and `pin_memory` is set, so host<->device copies of them can be
asynchronous; on a CPU-only machine pinning means nothing and is skipped.
[Note: kept contents] A buffer released with a `tag` (what its bytes are, in the releaser's terms) keeps
them until someone acquires it: `acquire()` hands out untagged buffers first, then the longest released,
and clears the tag, so `claim(tags)` later finds the bytes still there or finds nothing. The NVMe
stepper uses it to step the sub-groups it wrote last without reading them back (swapped_partition.py's
note: kept sub-groups); the bound is unchanged, kept buffers are free buffers.
[Note: huge pages] Unpinned buffers are cut from one block on transparent huge pages where the pool is
large enough (offload/huge_pages.py), for the disk's sake, not the CPU's: an O_DIRECT request is a list
of the buffer's physical pages, and on 4 KiB pages that the kernel handed out scattered each 1 MiB
request carries up to 256 segments, on 2 MiB pages one or two. Measured on this project's virtio disk
(12 buffers of 4 MiB, 12 requests in flight, 2026-12-07): reads 1.9-2.7x and writes 1.2-1.8x faster
than from 4 KiB-page buffers, and which of two identical 4 KiB-page pools was allocated first changed
their speed by 25% (how scattered their pages came out); bench_swapped_step.py's first section was 2-5x
slower than its second for that reason until then. Pinned buffers (an accelerator's) stay as its
allocator gives them.
"""
from __future__ import annotations

import threading

import torch

from offload import huge_pages
from offload.aio import aligned_empty, round_up


def _allocate(count: int, size: int, dtype: torch.dtype, pinned: bool) -> list[torch.Tensor]:
    """`count` host buffers of `size` elements, each starting on the O_DIRECT block (note: huge pages)."""
    stride = round_up(size * dtype.itemsize) // dtype.itemsize
    if huge_pages.eligible(count * stride * dtype.itemsize, pinned):
        block = huge_pages.host_empty(count * stride, dtype)
        return [block[i * stride:i * stride + size] for i in range(count)]
    return [aligned_empty(size, dtype, pin_memory=pinned) for _ in range(count)]


def accelerator_present() -> bool:
    return torch.cuda.is_available()


class SwapBufferPool:
    def __init__(self, buffer_count: int, buffer_size: int, dtype: torch.dtype = torch.float32,
                 pin_memory: bool = True, count_key: str = "zero_optimization.offload_optimizer.buffer_count"):
        if buffer_count < 1 or buffer_size < 1:
            raise ValueError(f"{count_key} must be at least 1 (got buffer_count={buffer_count}, "
                             f"buffer_size={buffer_size})")
        self.buffer_size, self.dtype, self.count_key = int(buffer_size), dtype, count_key
        self.pinned = bool(pin_memory) and accelerator_present()
        # host buffers on purpose (device="cpu" inside aligned_empty): the swap tier is host memory
        self._buffers = _allocate(buffer_count, self.buffer_size, dtype, self.pinned)
        for buf in self._buffers:
            buf.zero_()  # touch every page now: the bound is paid at construction, not mid-step
        self._free = list(range(buffer_count))  # in release order (note: kept contents)
        self._tags: dict[int, object] = {}  # free buffer index -> the tag it was released with
        self._ids = {buf.data_ptr(): i for i, buf in enumerate(self._buffers)}
        self._cond = threading.Condition()

    @property
    def buffer_count(self) -> int:
        return len(self._buffers)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer, free or not (read-only view for checks of where and how they were allocated)."""
        return tuple(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """A free buffer (all `buffer_size` elements); blocks until one is released."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError(f"no swap buffer free after {timeout}s; raise {self.count_key}")
            at = next((i for i, index in enumerate(self._free) if index not in self._tags), 0)
            index = self._free.pop(at)
            self._tags.pop(index, None)
            return self._buffers[index]

    def release(self, buffer: torch.Tensor, tag: object = None) -> None:
        """Give `buffer` back; with `tag`, its bytes stay claimable under it (note: kept contents)."""
        index = self._ids.get(buffer.data_ptr())
        if index is None:
            raise ValueError("release() of a tensor that is not one of this pool's buffers")
        with self._cond:
            if index in self._free:
                raise ValueError("release() of a swap buffer that is already free")
            self._free.append(index)
            if tag is not None:
                self._tags[index] = tag
            self._cond.notify()

    def kept(self, tag: object) -> torch.Tensor | None:
        """The free buffer released with `tag` and untouched since, left free (its releaser may update its
        bytes in place), or None (note: kept contents)."""
        with self._cond:
            index = next((i for i, t in self._tags.items() if t is tag), None)
            return None if index is None else self._buffers[index]

    def claim(self, tags: list) -> list[torch.Tensor] | None:
        """The free buffers released with `tags` (in that order), taken as `acquire` takes buffers, if every
        one of them is still untouched; else None and nothing taken (note: kept contents)."""
        with self._cond:
            where = {tag: index for index, tag in self._tags.items()}
            found = [where.get(tag) for tag in tags]
            if not tags or None in found:
                return None
            for index in found:
                self._free.remove(index)
                del self._tags[index]
            return [self._buffers[index] for index in found]
