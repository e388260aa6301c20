"""`Staging`: host buffers for the swap transfers that do not go through a pool, reused once nothing
holds them.

[Note: why reuse] The gradient swap reads each sub-group's gradient into a buffer of its own and writes
each landing from one (engine/zero/grad_swap.py), the parameter store stages its write-behind
(offload/param_swap.py): a few MiB each, many per step. Allocated afresh, each is a new mapping where the
heap bound fixes glibc's mmap threshold (offload/host_heap.py): a thousand page faults before the
transfer, and an O_DIRECT request over scattered 4 KiB pages, which this machine's disk serves at half
the speed of a buffer on huge pages (offload/pool.py's note: huge pages; a 4 MiB read 15-19 ms into a
fresh buffer against 9-10 into a reused one on huge pages, loaded machine, 2026-12-07). So `empty`
hands out a view of a base it keeps, on huge pages where the base spans one, and takes a base back
once no tensor but its own refers to its storage: the caller's views, the I/O engine's buffers of a
transfer in flight (aio.py holds a view of what it reads or writes until the transfer lands) and
anything the caller passed the view to all count, so a base is never handed out while its bytes are
still wanted. Torch counts those references (`torch._C._storage_Use_Count`); without that function
nothing is reused and every buffer is fresh, as before.
[Note: bound] A base that does not fit a request is dropped when a new one is made (the sizes a phase
asks for replace the last phase's), and at most `KEEP` are kept: host memory stays what the buffers in
use need, plus bases no larger than a request that came.
"""
from __future__ import annotations

import torch

from offload import huge_pages
from offload.aio import ALIGNMENT, round_up

KEEP = 8  # bases kept at most (note: bound)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Staging:
    """Reusable host staging buffers (module note)."""

    def __init__(self) -> None:
        self._bases: list[torch.Tensor] = []  # uint8 host tensors, each 2 MiB-aligned where it spans one
        self.reused = self.made = 0  # buffers handed out from a kept base / from a new one (tests count them)

    def empty(self, numel: int, offset_elements: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`numel` uninitialised elements of `dtype` at an address congruent to the file offset of
        `offset_elements` modulo the O_DIRECT block, so a transfer of it at that offset goes direct."""
        size = dtype.itemsize
        phase = offset_elements * size % ALIGNMENT
        need = phase + numel * size
        idle = {id(b): b for b in self._bases if _idle(b)}  # by identity: == on tensors compares values
        fits = [b for b in idle.values() if b.numel() >= need]
        if fits:
            base = min(fits, key=torch.Tensor.numel)
            self.reused += 1
        else:
            self._bases = [b for b in self._bases if id(b) not in idle]  # (note: bound)
            base = _new_base(need)
            self.made += 1
            if _use_count is not None and len(self._bases) < KEEP:
                self._bases.append(base)
        return base[phase:need].view(dtype)

    def clear(self) -> None:
        self._bases = []


def _idle(base: torch.Tensor) -> bool:
    """No tensor but `base` refers to its storage (the count includes the temporary storage object)."""
    return _use_count is not None and _use_count(base.untyped_storage()._cdata) == 2


def _new_base(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of at least `nbytes`, on huge pages where it spans a whole one (it is kept, so
    huge_pages.MIN_BYTES's concern, a heap block already written on small pages, is paid once)."""
    nbytes = round_up(nbytes)
    if nbytes < huge_pages.HUGE_PAGE or not huge_pages.available():
        return huge_pages.host_empty(nbytes, torch.uint8, alignment=ALIGNMENT)
    return huge_pages.advised_empty(nbytes)
