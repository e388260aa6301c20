"""`MasterFile`: `SwappedPartition`'s committed fp32 master read and written alone, between steps (the
parameter store's gathers, checkpoints, `safe_get_*`, `GatheredParameters` edits: offload/param_swap.py's
notes, 16-bit files and the master's file). A part of `SwappedPartition` (offload/swapped_partition.py,
whose module notes it follows), kept in a module of its own for size: it reads the partition's layout
(`numel`, `sub_group_size`, `groups`, `stride_bytes`), its committed slot and its pending writes."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from offload.aio import IOHandle, started

MASTER = "master"


class MasterFile:
    def _master_runs(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(a, b, byte offset): the parts of elements [start, stop), one per sub-group they fall in."""
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"master elements [{start}, {stop}) are outside this partition's {self.numel}")
        a = start
        while a < stop:
            k = a // self.sub_group_size
            b = min(stop, self.groups[k][1])
            yield a, b, k * self.stride_bytes + (a - self.groups[k][0]) * 4
            a = b

    def start_read_master(self, out: torch.Tensor, start: int) -> list[IOHandle]:
        """Read elements [start, start + len(out)) of the committed fp32 master into `out`, the requests
        started and not waited for (the parameter store's gathers read the master here: offload/
        param_swap.py's note, the master's file)."""
        if self._initial is not None:
            raise RuntimeError("the master is still the caller's host copy (deferred initialisation): read it there")
        self._finish_writes()
        return self._master_requests(self.aio.read, out, start)

    def read_master(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the committed fp32 master: a new tensor."""
        self._finish_writes()
        if self._initial is not None:  # nothing written yet (module note: deferred initialisation)
            return self._initial(start, stop).to(dtype=torch.float32, copy=True)
        out = torch.empty(stop - start, dtype=torch.float32, device="cpu")
        self._master_transfer(self.aio.read, out, start)
        return out

    @property
    def master_deferred(self) -> bool:
        """Whether the master is still the caller's host copy (module note: deferred initialisation)."""
        return self._initial is not None

    def write_master(self, start: int, values: torch.Tensor) -> None:
        """Replace elements [start, start + len(values)) of the committed master in place (a checkpoint
        load's or a `GatheredParameters` edit's values), the state and the other slot untouched."""
        if self._initial is not None:
            raise RuntimeError("the master is still the caller's host copy (deferred initialisation): write it there")
        self._finish_writes()
        self._kept = None  # the kept buffers hold the master before this write (module note: kept sub-groups)
        self._generation += 1  # the other slot no longer holds what `revert` would go back to
        self._master_transfer(self.aio.write, values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
                              .contiguous(), start)

    def _master_transfer(self, op: Callable, values: torch.Tensor, start: int) -> None:
        """`op` (the I/O engine's read or write) of `values` at master elements [start, start + len(values))
        of the committed slot, one request per sub-group it meets, all waited for."""
        for handle in self._master_requests(op, values, start):
            handle.wait()

    def _master_requests(self, op: Callable, values: torch.Tensor, start: int) -> list[IOHandle]:
        path, stop = self._file(MASTER, self._slot), start + values.numel()
        self._check_committed({MASTER: self._slot}, start, stop)
        return started(op(path, values[a - start:b - start], at) for a, b, at in self._master_runs(start, stop))
