"""The one way to read and write a rank's fp32 master partition (the flat of `PartitionedParams`).

[Note: partition store] At stage 3 the fp32 master partition is also what the parameter all-gathers
send, so many places read it: the gather sources (`GroupSources`), the persistent-parameter refresh
after a step, `safe_get_*` (engine/utils.py), the checkpoint adapters, the NVMe optimizer tier
(initial master, updated master after each sub-group) and `state_dict`. They all go through
`partition.store`, so where the partition lives is the store's business:
- `HostPartitionStore` (this module): the flats in memory (device or host), every read a zero-copy
  view, every write a copy into it. No offload and the CPU tier use it; NVMe optimizer offload its
  subclasses `TierMasterStore` and `HalfImageStore`, whose writes also reach the tier's master.
- `NvmeParamStore` (offload/param_swap.py, `offload_param.device: "nvme"`): the partition in swap
  files, read through a buffer pool ahead of the gathers.
`read(key, start, stop)` returns elements [start, stop) of flat `key` (valid until the next write of
that range; a view for the host store, a new tensor for the NVMe one); `write(key, start, values)`
stores them (`write_image`: only what the all-gathers send, where the caller keeps the master itself;
the same as `write` for this store; `read_image` reads it back); `master_updated()` tells the store the
optimizer changed the in-memory master (a step, a load), which the NVMe store copies to its files.
`open_slots` / `close_slots` / `read_ahead` serve the gathers: the slots of several parameters at once,
through pool buffers for the NVMe store; `persistent_slots` the refresh of the persistent parameters
after a step.
[Note: a refused image] With the optimizer on NVMe a step that fails halfway has already written some
updated sub-groups into what the gathers send; the tier puts the committed master back, and where that
fails too (engine/zero/nvme_tier.py's `unrestored`) the image is half-updated. The stores that hold such
an image (`TierMasterStore`, `NvmeParamStore`) then refuse every read of it, the gathers' (a forward, a
`GatheredParameters` block) and `read`'s (`safe_get_*`, a state dict), with the tier's one error
(`check_image`: load a checkpoint), as the next step is refused; a checkpoint save streams the committed
master from the tier instead (checkpoint/nvme.py), and a load lifts the refusal (nvme_tier.py's
`load_chunks`). Writes are not refused: they are how the image is put right.
"""
from __future__ import annotations

import torch

from offload.huge_pages import flat_empty


class HostPartitionStore:
    """The partition's flats themselves (module note): reads are views, nothing is copied."""

    swapped = False  # the master lives in memory: `partition.flat` holds it

    def __init__(self, partition):
        self.partition = partition

    def read(self, key, start: int, stop: int) -> torch.Tensor:
        return self.partition.flat[key].detach()[start:stop]

    def write(self, key, start: int, values: torch.Tensor) -> None:
        dst = HostPartitionStore.read(self, key, start, start + values.numel())  # the flat, never refused
        if dst.data_ptr() != values.data_ptr():  # a reader that filled the view in place wrote it already
            dst.copy_(values.reshape(-1))

    def slot(self, param) -> torch.Tensor:
        """`param`'s padded slot (`Fragment.padded` elements)."""
        frag = self.partition.fragments[param]
        return self.read(frag.key, frag.offset, frag.offset + frag.padded)

    def open_slots(self, params: list) -> list[torch.Tensor]:
        return [self.slot(p) for p in params]

    def close_slots(self, params: list) -> None:
        pass

    def persistent_slots(self, params: list) -> list[torch.Tensor]:
        return [self.slot(p) for p in params]

    def read_ahead(self, params: list) -> bool:
        return False  # nothing to read: the slots are in memory

    def write_behind(self, key, start: int, values: torch.Tensor) -> None:
        self.write(key, start, values)  # a copy in memory: nothing to overlap

    def write_image(self, key, start: int, values: torch.Tensor) -> None:
        self.write(key, start, values)  # the flat is what the all-gathers send

    def read_image(self, key, start: int, stop: int) -> torch.Tensor:
        return self.read(key, start, stop)  # the same flat

    def flush(self) -> None:
        pass  # nothing in flight

    def master_updated(self) -> None:
        pass

    def resident_bytes(self) -> int:
        return sum(f.untyped_storage().nbytes() for f in self.partition.flat.values())

    def close(self) -> None:
        pass


class TierMasterStore(HostPartitionStore):
    """[Note: master in the tier] With the optimizer on NVMe (engine/zero/nvme_tier.py) the fp32 master is
    in the tier's swap files, and the flats in memory are what the all-gathers send: its exact copy, which
    each step's update reaches through `write_behind`. Readers read the flats. A writer of new master
    values (a `GatheredParameters` edit at stage 3, a state-dict load) must reach the tier's files too, or
    the next step steps from the old master there and writes the edit away: `write` writes both, and
    `write_image` / `write_behind` only what the all-gathers send, the tier having written its files
    itself. Until `fast_init`'s first step the tier has no master of its own and reads the flats
    (offload/swapped_partition.py's note: deferred initialisation), so then only they are written."""

    def __init__(self, partition, master_source):
        super().__init__(partition)
        self.master_source = master_source

    def read(self, key, start: int, stop: int) -> torch.Tensor:
        if self.master_source.unrestored:  # module note: a refused image (slot, open_slots read here too)
            self.master_source.check_image([key])
        return super().read(key, start, stop)

    def write(self, key, start: int, values: torch.Tensor) -> None:
        if self.master_source.holds_master(key):
            self.master_source.write_master(key, start, values)
        self.write_image(key, start, values)

    def write_image(self, key, start: int, values: torch.Tensor) -> None:
        HostPartitionStore.write(self, key, start, values)

    write_behind = write_image


class HalfImageStore(TierMasterStore):
    """[Note: 16-bit send image] Stages 1-2 with the optimizer on NVMe in fp16/bf16 training: the host keeps
    only what the all-gathers send, in the model dtype (`image`, a tensor per flat on the tier's home,
    pinned where the tier pins), and the fp32 master is the NVMe optimizer's (`master_source`:
    `read_master` / `write_master`); the flats' own bytes are freed. So the host holds 2 bytes per
    partition element instead of 4, as stage 3's 16-bit parameter files do (offload/param_swap.py's
    note). `read` / `slot` are the fp32 master's (checkpoints, `safe_get_*`, a state-dict load);
    `read_image` is what `_gather_params` sends; `write` reaches both (note: master in the tier), a
    step's update (`write_behind`) and a checkpoint load's (`write_image`) only the image, the tier
    having written the master itself. Values are those of the fp32 flat it replaces: the image is the
    master cast as the gather would cast it. Not with `fast_init` (nvme_tier.py's `attach_master_store`)."""

    master_in_memory = False  # the checkpoint adapter streams the fp32 rows from the tier (checkpoint/nvme.py)

    def __init__(self, partition, master_source, tier):
        super().__init__(partition, master_source)
        self.image = {}
        for key, flat in partition.flat.items():
            image = flat_empty(flat.numel(), key[1], tier.home, pin_memory=tier.pin)
            image.copy_(flat.detach())
            self.image[key] = image
            flat.detach().untyped_storage().resize_(0)

    def read(self, key, start: int, stop: int) -> torch.Tensor:
        return self.master_source.read_master(key, start, stop)

    def write_image(self, key, start: int, values: torch.Tensor) -> None:
        values = values.detach().reshape(-1)
        self.image[key][start:start + values.numel()].copy_(values)

    write_behind = write_image

    def read_image(self, key, start: int, stop: int) -> torch.Tensor:
        return self.image[key][start:stop]

    def resident_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.image.values())


class GroupSources:
    """The padded chunks one gather group sends: trainable parameters' slots from the partition store
    (looked up at each use, so the store can be swapped after the groups are built), frozen chunks
    from `frozen` (stage3_frozen.py: model dtype, in memory or in a file)."""

    def __init__(self, partition, params: list, frozen):
        self.partition, self.params, self.frozen = partition, params, frozen
        self.trainable = [p for p in params if p in partition.fragments]
        self.frozen_params = [p for p in params if p not in partition.fragments]

    def open(self) -> list[torch.Tensor]:
        """Every parameter's chunk, in `params` order; `close()` when they are copied."""
        slots = dict(zip(self.trainable, self.partition.store.open_slots(self.trainable)))
        return [slots[p] if p in slots else self.frozen.get(p) for p in self.params]

    def close(self) -> None:
        self.partition.store.close_slots(self.trainable)

    def read_ahead(self) -> bool:
        started = bool(self.frozen_params) and self.frozen.read_ahead(self.frozen_params)  # stage3_frozen.py
        return (bool(self.trainable) and self.partition.store.read_ahead(self.trainable)) or started

    @torch.no_grad()
    def write(self, i: int, chunk: torch.Tensor) -> None:
        """Parameter i's new padded chunk (GatheredParameters with a modifier rank)."""
        p = self.params[i]
        if p not in self.partition.fragments:
            self.frozen.put(p, chunk)
            return
        frag = self.partition.fragments[p]
        self.partition.store.write(frag.key, frag.offset, chunk.to(torch.float32))
