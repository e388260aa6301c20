"""The bytes an NVMe optimizer step moves (offload/swapped_partition.py), counted per request of the I/O
engine: deterministic, unlike its time. What the step saves must change no bit of the result, so every
test here also compares with the in-memory optimizer over the whole flat, exactly.

- A flat's last sub-group is shorter than the pool buffer: its reads and writes move its own elements
  (rounded up to the O_DIRECT block), not the whole buffer.
"""
from __future__ import annotations

import torch

from offload.aio import round_up
from tests.test_offload_stepper import OPTIMIZERS, Swapped, data, reference


class Counted:
    """Wraps a Swapped's I/O engine: bytes asked for by reads and writes, per file name."""

    def __init__(self, swapped: Swapped):
        self.read = self.written = 0
        io = swapped.io
        read, write = io.read, io.write

        def counted_read(path, tensor, offset=0):
            self.read += tensor.numel() * tensor.element_size()
            return read(path, tensor, offset)

        def counted_write(path, tensor, offset=0):
            self.written += tensor.numel() * tensor.element_size()
            return write(path, tensor, offset)
        io.read, io.write = counted_read, counted_write

    def take(self) -> tuple[int, int]:
        out = (self.read, self.written)
        self.read = self.written = 0
        return out


def test_the_short_last_sub_group_moves_its_own_bytes_not_the_whole_buffer(tmp_path):
    numel, sub_group = 5000, 2048  # sub-groups of 2048, 2048 and 904 elements
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=3, numel=numel)
    swapped = Swapped(tmp_path, make, numel, sub_group, pipeline=(True, True), buffers=9)
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        counted = Counted(swapped)
        tensors = 1 + len(swapped.part.state_keys)
        per_step = tensors * (2 * round_up(2048 * 4) + round_up(904 * 4))
        swapped.step(grads[0])  # the first step reads the master alone
        assert counted.take() == (per_step // tensors, per_step)
        for grad in grads[1:]:
            swapped.step(grad)
            assert counted.take() == (per_step, per_step)
        want, _ = reference(make, master, grads)
        assert torch.equal(swapped.model, want)
    finally:
        swapped.close()
