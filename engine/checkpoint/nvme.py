"""Checkpoints of a stage-1/2 partition whose optimizer state lives in swap files (engine/zero/nvme_tier.py).

`NvmeAdapter` is `PartitionedAdapter` (state.py) over the same fragments, with the optimizer state read
from and written to the swap files instead of `optimizer.state`: so a checkpoint saved with NVMe offload
is the one saved without it (same keys, same layout) and loads into any stage, offload setting and
world size, and the other way round.
[Note: memory at save] The save reads each flat's state with `state_chunks()`, one sub-group at a time,
into flat-sized host tensors that the snapshot then packs and writes: while a save runs, this rank's
whole optimizer state is in host memory once (what the checkpoint format's one torch.save per rank
needs). Writing the rank file sub-group by sub-group would remove that peak; not built yet.
"""
from __future__ import annotations

import torch

from .state import PartitionedAdapter


class NvmeAdapter(PartitionedAdapter):
    def __init__(self, zopt, rank: int, world: int):
        super().__init__(zopt, rank, world)
        self.nvme = zopt.nvme
        self._state: dict[tuple, dict] = {}  # key -> the state read for this save (module note)

    def row_kinds(self) -> set[str]:
        """The per-element state kinds: the configured optimizer holds no state, so its layout names
        none (state_layout.py); the swapped keys are the stepper's own."""
        return {k for part in self.nvme.parts.values() for k in part.state_keys}

    def _swapped_state(self, key) -> dict:
        if key not in self._state:
            flat = self.part.flat[key]
            state: dict = {}
            for chunk in self.nvme.state_chunks(key):
                for kind, value in chunk["state"].items():
                    if kind not in state:
                        state[kind] = torch.zeros(flat.shape, dtype=value.dtype, device=value.device)
                    state[kind][chunk["start"]:chunk["end"]].copy_(value)
                for kind, value in chunk["scalars"].items():
                    state.setdefault(kind, value)  # per-step scalars (Adam's step) are equal in every sub-group
            self._state[key] = state
        return self._state[key]

    def read(self, p, kinds: set[str]) -> dict:
        key = self.part.fragments[p].key
        optimizer_state = self.zopt.optimizer.state
        flat = self.part.flat[key]
        optimizer_state[flat] = self._swapped_state(key)  # lent for the base read, taken back at once
        try:
            return super().read(p, kinds)
        finally:
            optimizer_state.pop(flat, None)

    def finish_load(self) -> None:
        """The loaded master rows and state go into the swap files, one chunk per flat; the configured
        optimizer keeps no state (nvme_tier.py's note)."""
        super().finish_load()
        for key, flat in self.part.flat.items():
            state = self.zopt.optimizer.state.pop(flat, {})
            elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape}
            scalars = {k: v for k, v in state.items() if k not in elementwise}
            self.nvme.load_chunks(key, [{"start": 0, "end": flat.numel(), "master": flat.detach(),
                                         "state": elementwise, "scalars": scalars}])
