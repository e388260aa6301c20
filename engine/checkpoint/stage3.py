"""ZeRO stage 3 in checkpoints: the same per-parameter fragments as stages 1-2, from placeholders.

[Note: stage 3] Between uses a stage-3 module parameter is an empty placeholder (`p.data` has shape
[0], `p.ds_shape` the full shape; zero/stage3_params.py's note), so nothing may be read from or written
into it. Everything comes from the stage's partition metadata instead:
- trainable parameters: this rank's rows are its `Fragment` of the fp32 flat partition (the master
  weights, which the stage's all-gathers cast to the model dtype), so saving and loading them is
  `PartitionedAdapter`'s; only the full shape differs (`shape`).
- frozen partitioned parameters live in `zopt.frozen_chunks` (model dtype, padded 1-D): each rank
  writes its rows as kind "module" fragments and loads just its rows back (`entry_rows`), instead of
  rank 0 writing a whole tensor that no rank holds.
- persistent (small, kept whole) parameters and any gathered copies are stale after a load:
  `finish_load` releases gathered groups and re-gathers the persistent ones from the fresh masters, the
  same cast a step ends with, so a resumed run stays bitwise exact.
Stage 3 keeps no 16-bit copy of its partition, so there is nothing else to refresh.
"""
from __future__ import annotations

import torch

from ..zero.stage3_params import full_shape, spec_of
from .nvme import NvmeAdapter
from .state import PartitionedAdapter


class Stage3Adapter(PartitionedAdapter):
    """Stage 3: `PartitionedAdapter` over the fp32 partition, module parameters left as placeholders."""

    holds_module_weights = False  # restore.py: never copy full rows into a placeholder

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return full_shape(t)

    def entry_rows(self, t: torch.Tensor):
        """(start, stop, rows view) of a frozen module tensor this rank holds a chunk of, else None
        (a tensor kept whole: buffers, frozen persistent parameters)."""
        chunk = self.zopt.frozen_chunks.get(t)
        if chunk is None:
            return None
        shape = full_shape(t)
        spec = spec_of(shape, self.world)
        start, stop = spec.row_range(self.rank)
        rows = chunk[:spec.numel_of(self.rank)].view((stop - start,) + tuple(shape[1:]))
        return start, stop, rows

    def entry_rows_loaded(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        """In memory `rows` is a view of the chunk; a chunk in a file (offload_param on NVMe,
        engine/zero/stage3_frozen.py) was read into a new tensor and is written back."""
        self.zopt.frozen_chunks.loaded(t, rows)

    def finish_load(self) -> None:
        super().finish_load()
        self.zopt.refresh_after_load()


class Stage3NvmeAdapter(NvmeAdapter, Stage3Adapter):
    """Stage 3 with `offload_optimizer.device: "nvme"`: the state from the swap files (NvmeAdapter), the
    shapes and frozen chunks of stage 3."""

    def finish_load(self) -> None:
        """NvmeAdapter fills the host flat and the swap files sub-group by sub-group; only then can the
        gathered copies be refreshed from the flat (Stage3Adapter's step, without its row copy, which
        NvmeAdapter's streamed load replaces)."""
        NvmeAdapter.finish_load(self)
        self.zopt.refresh_after_load()
