"""`ChunkFile` and `SwappedChunk`: parameter chunks appended once to a swap file, then read or replaced
whole (zero.Init(remote_device="nvme")'s chunks and stage 3's frozen ones). Moved out of param_swap.py,
which holds the trainable partition's store (`NvmeParamStore`)."""
from __future__ import annotations

import weakref

import torch

from offload.aio import AsyncFileIO
from offload.swap_dir import SwapDir

CPU = torch.device("cpu")


class ChunkFile:
    """A file of parameter chunks, each appended once and then read or replaced whole: `zero.Init(
    remote_device="nvme")`'s (`kind` "init": each chunk written as its module is built, so the model never
    exists in host memory, until `NvmeParamStore` copies them into its own layout), and stage 3's frozen
    chunks (`kind` "frozen": engine/zero/stage3_frozen.py)."""

    def __init__(self, swap: SwapDir, io: AsyncFileIO, name: str, kind: str = "init"):
        self.swap, self.io, self.path = swap, io, swap.file(f"{name}.{kind}.swp")
        self.end = 0  # bytes used; every chunk starts on an O_DIRECT boundary (aio.py's note)
        self.freed = 0  # bytes of slots no chunk refers to any more (`_free`)
        self.closed = False
        self._dead: list[tuple[int, int]] = []  # slots whose SwappedChunk went, not punched yet (`_free`)

    def put(self, chunk: torch.Tensor) -> "SwappedChunk":
        self._punch_dead()
        offset = self.end
        self.io.write(self.path, chunk.detach().to(device=CPU).contiguous(), offset).wait()
        self.end = -(-(offset + chunk.numel() * chunk.element_size()) // 4096) * 4096
        out = SwappedChunk(self, offset, chunk.numel(), chunk.dtype)
        # [Note: dead slots] Slots are appended, never reused: a chunk replaced by a new slot (a parameter
        # resized inside GatheredParameters: transformers' resize_token_embeddings) or dropped with its
        # parameter (a replaced lm_head) left its bytes on disk until the file was removed at initialize
        # (measured: 8 of 56 KiB of a small Llama's file after a resize). When its SwappedChunk goes, the
        # slot's blocks go back to the file system (a hole; the file keeps its size and the other offsets).
        weakref.finalize(out, self._free, offset, self.end - offset).atexit = False
        return out

    def _free(self, offset: int, nbytes: int) -> None:
        """The finalizer: it may run in a garbage collection anywhere, inside the I/O engine's own locks
        too, so a slot it cannot punch without waiting is punched at the next `put` or `_free`."""
        self.freed += nbytes
        self._dead.append((offset, nbytes))
        self._punch_dead()

    def _punch_dead(self) -> None:
        # each slot is taken off the list before its punch: a finalizer running inside it (a collection on
        # this thread, or another thread's) punches only the others, never drops this one for us
        while self._dead and not self.closed:
            try:
                slot = self._dead.pop(0)
            except IndexError:  # another thread's call took the last one
                return
            if not self.io.discard(self.path, *slot):
                self._dead.insert(0, slot)
                return

    def close(self) -> None:
        self.closed = True
        try:
            self.io.close()
        finally:
            self.swap.close()


class SwappedChunk:
    """A padded parameter chunk in a `ChunkFile`: `load()` reads it, `store(t)` replaces it."""

    def __init__(self, file: ChunkFile, offset: int, numel: int, dtype: torch.dtype):
        self.file, self.offset, self.numel, self.dtype = file, offset, numel, dtype

    def load(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype, device=CPU)
        self.file.io.read(self.file.path, out, self.offset).wait()
        return out

    def store(self, values: torch.Tensor) -> None:
        self.file.io.write(self.file.path, values.detach().to(device=CPU, dtype=self.dtype).contiguous(),
                           self.offset).wait()
