"""`contiguous_memory_optimization`: the partitioned inputs that checkpoints save, copied into
preallocated buffers instead of one small allocation each (DeepSpeed's defence against
fragmentation of accelerator memory when many checkpoints' partitions live until backward).

[Note: slots] There is one buffer per input position of a checkpoint (the i-th floating tensor
argument of each `checkpoint()` call), of shape (number_checkpoints, partition numel), on the
device where the partitions are kept (host memory, pinned on an accelerator, with
cpu_checkpointing); the k-th checkpoint of a forward writes its partition into slot k. Inputs of
another size or dtype at one position get a buffer of their own. When the first backward unpacks
a partition, the buffers are let go (as DeepSpeed does at its first backward): the slots already
handed out keep their buffer alive until autograd frees them, and the next forward allocates
fresh ones; `reset()` lets go of them too (DeepSpeed's, for forwards without a backward, e.g. in
evaluation). More checkpoints in one forward than `number_checkpoints` is an error naming the key.
"""
from __future__ import annotations

import torch

from .probe import report_held


class ContiguousSlots:
    def __init__(self):
        self._buffers: dict = {}  # (position, numel, dtype, device) -> [buffer, next slot, probe token]

    def copy_in(self, position: int, part: torch.Tensor, slots: int, device: torch.device):
        """`part` (flat) copied into the next free slot of its buffer; returns (slot view, probe token).
        The token stands for the whole buffer: keep it with the slot."""
        key = (position, part.numel(), part.dtype, device)
        entry = self._buffers.get(key)
        if entry is None:
            pinned = device.type == "cpu" and part.device.type != "cpu"
            buffer = torch.empty((slots, part.numel()), dtype=part.dtype, device=device, pin_memory=pinned)
            entry = self._buffers[key] = [buffer, 0, report_held(buffer.numel() * buffer.element_size())]
        buffer, slot, token = entry
        if slot >= slots:
            raise RuntimeError(f"activation_checkpointing.number_checkpoints: {slots} slots are full: this forward "
                               f"runs more than {slots} checkpoints before a backward; raise number_checkpoints "
                               "to the number of checkpointed regions per forward")
        entry[1] = slot + 1
        # the slot as a tensor of its own over the buffer's storage: a view would share the buffer's
        # version counter, and filling the next slot would then invalidate this one where autograd saved it
        view = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
        view.set_(buffer.untyped_storage(), slot * buffer.shape[1], (buffer.shape[1],))
        view.copy_(part, non_blocking=view.device != part.device and (view.is_pinned() or part.is_pinned()))
        return view, token

    def release(self) -> None:
        self._buffers.clear()

    def buffers(self) -> list[torch.Tensor]:
        """The buffers of the forward in progress (for tests and inspection)."""
        return [entry[0] for entry in self._buffers.values()]


SLOTS = ContiguousSlots()
