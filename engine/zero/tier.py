"""Where a ZeRO partition's fp32 flats live (DESIGN decisions 6 and 10): the accelerator, or host memory
(ZeRO-Offload, `offload_optimizer.device: "cpu"`, and at stage 3 `offload_param.device: "cpu"`).

[Note: tier] The stages decide *what* is partitioned; a `PartitionTier` decides *where* the master
weights, their gradient and (built over them by the optimizer) its state live: `home`. When `home` is
not the collectives' `device`, the partition is *staged*: a reduced gradient segment lands in a
buffer on `device` and is copied to the host as soon as its collective finished (non_blocking into
pinned memory, so the copy overlaps the rest of backward), and the host adds or copies it into the
partition gradient once an event says every copy of the backward arrived (`HostGradients`); updated
weights go back to `device` bucket by bucket in the all-gather after the step, and the optimizer
steps on the host with torch's fused CPU kernel. When `home` is `device` (no offload, or offload on a
CPU-only machine) nothing is staged: the flats are the same tensors the stage uses without offload,
so offload costs nothing there. `DSTRAIN_OFFLOAD_STAGE_COPIES=1` stages even then, so the copy path
runs (and is tested) on CPU-only machines.
[Note: stage 3] Stage 3 keeps no 16-bit copy of the partition: its fp32 master chunk is what the
all-gather sends. So at stage 3 either offload section puts that one partition on the host, and each
gather copies the chunks it sends host→device (in the prefetcher, ahead of use). With
`offload_param` alone the optimizer therefore also steps on the host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from offload.huge_pages import flat_empty

from .partition import land_slots

CPU = torch.device("cpu")


@dataclass(frozen=True)
class PartitionTier:
    device: torch.device  # where the collectives and the model run (the communicator's device)
    home: torch.device  # where the fp32 flats live
    pin: bool = False  # page-locked host flats: only for a host home next to an accelerator
    staged: bool = False  # home is not device (or staging is forced): copies go through buffers
    widen_on_host: bool = True  # offload_optimizer.convert_grad_on_cpu

    @classmethod
    def on_device(cls, device: torch.device) -> "PartitionTier":
        return cls(device, device)

    @classmethod
    def for_zero(cls, device: torch.device, zero) -> "PartitionTier":
        """The tier `zero_optimization` asks for: host memory when an offload section says "cpu"."""
        offload_optimizer, offload_param = zero.offload_optimizer, zero.offload_param  # the sections
        optimizer_off = offload_optimizer is not None and offload_optimizer.device in ("cpu", "nvme")  # nvme_tier.py
        # "nvme" (param_nvme.py): the partition is placed as for "cpu", and its store is swapped after
        param_off = zero.stage == 3 and offload_param is not None and offload_param.device in ("cpu", "nvme")
        if not (optimizer_off or param_off):
            return cls.on_device(device)
        pin = device.type != "cpu" and ((optimizer_off and offload_optimizer.pin_memory)
                                        or (param_off and offload_param.pin_memory))
        staged = device != CPU or os.environ.get("DSTRAIN_OFFLOAD_STAGE_COPIES") == "1"
        widen = offload_optimizer.convert_grad_on_cpu if optimizer_off else True
        return cls(device, CPU, pin=pin, staged=staged, widen_on_host=widen)

    @property
    def offloaded(self) -> bool:
        return self.home.type == "cpu" and (self.device.type != "cpu" or self.staged)

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` on the home tier (pinned when the tier pins); the same tensor when it is there already."""
        if flat.device == self.home and (not self.pin or flat.is_pinned()):
            return flat
        out = flat_empty(flat.numel(), flat.dtype, self.home, pin_memory=self.pin).view(flat.shape)
        out.copy_(flat)
        return out

    def to_device(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on `device` holding `src` cast to `dtype` (the updated weights of one gather bucket).
        From pinned memory the copy is asynchronous on the current stream, which the all-gather that
        reads the result is ordered after; the host overwrites `src` only in the next step, after the
        gradient norm's host read has synchronised that stream."""
        if not self.staged:
            return src.to(dtype)
        out = torch.empty(src.shape, dtype=dtype, device=self.device)
        out.copy_(src, non_blocking=self.pin)
        return out


def copy_chunks(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy `srcs` into `dsts`: one fused copy on one device; from a host partition into a device send
    buffer one asynchronous copy per chunk (ordered before the collective that reads `dsts`)."""
    if all(d.device == s.device for d, s in zip(dsts, srcs)):
        torch._foreach_copy_(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=s.is_pinned())


class HostGradients:
    """Reduced gradient segments on their way from `device` to the host partition gradient (the tier's
    note): `arrive` starts the copy, `land` waits for every copy of the backward and applies them in
    arrival order, so accumulation adds them exactly as the unstaged path would."""

    def __init__(self, tier: PartitionTier):
        self.tier = tier
        self.pending: list[tuple] = []
        self._event = None

    def arrive(self, targets: list[torch.Tensor], layout, segment: torch.Tensor, accumulate: bool,
               after: float) -> None:
        """Start copying `segment` (this rank's reduced segment in the wire dtype) to the host; `after` is
        the post-reduction scale, applied in fp32 on landing as the unstaged path applies it."""
        if not self.tier.widen_on_host:
            segment = segment.float()
        host = torch.empty(segment.shape, dtype=segment.dtype, device=self.tier.home, pin_memory=self.tier.pin)
        host.copy_(segment, non_blocking=self.tier.pin)
        self.pending.append((targets, layout, host, accumulate, after))
        if self.tier.device.type != "cpu":
            self._event = torch.Event(device=self.tier.device)
            self._event.record()

    def land(self) -> None:
        """Wait for the copies (one event: they are ordered on one stream) and write the partition gradient."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        for targets, layout, host, accumulate, after in self.pending:
            seg = host.float()
            if after != 1.0:
                seg.mul_(after)
            land_slots(targets, layout.segment_slots(seg), accumulate)
        self.pending.clear()


def tier_tensors(zopt) -> dict[str, list[torch.Tensor]]:
    """The tensors of a ZeRO-1/2/3 partition whose place the tier decides, by role (read-only; for checks
    such as benchmarks/gpu/offload_checks.py that must not depend on where each swapper keeps them):
    - "master": the fp32 flats: the master weights, or with `offload_optimizer.device: "nvme"` the
      all-gather's send image; left out once the NVMe parameter store freed their bytes (param_nvme.py);
      at stages 1-2 in 16-bit training with the optimizer on NVMe the 16-bit send image that replaced them
      (partition_store.py's note: 16-bit send image);
    - "master_grad": their gradients (none while the gradient partition is in swap files, grad_swap.py);
    - "optimizer_state": the configured optimizer's tensors (none with NVMe: its state is in swap files);
    - "swap_buffers": the buffers of the NVMe optimizer tier's pool and of the NVMe parameter store's pool.
    On a host tier next to an accelerator (`zopt.tier.pin`) the flats and the pools are what host<->device
    copies read and write asynchronously, so they are pinned."""
    flats = [f.detach() for f in zopt.partition.flat.values() if f.untyped_storage().nbytes() > 0]
    flats += list(getattr(zopt.partition.store, "image", {}).values())
    pools = [zopt.nvme.pool] if zopt.nvme is not None else []
    pools += [zopt.partition.store.pool] if zopt.partition.store.swapped else []
    state = [t for s in zopt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"master": flats, "master_grad": [g for g in zopt.partition.flat_grad.values() if not g.is_meta],
            "optimizer_state": state, "swap_buffers": [b for pool in pools for b in pool.buffers]}
