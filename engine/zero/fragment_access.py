"""The engine.utils.safe_get_* accessors of a stage 1/2 partition (partitioned.py): a parameter's full
fp32 master, gradient and optimizer state gathered from every rank's fragment of it, or this rank's own
rows. A mixin over PartitionedZeroOptimizer's partition, communicator, optimizer and tiers."""
from __future__ import annotations

import torch

from offload.aio import OffloadIOError
from ops.state_layout import ELEMENTWISE, declared_layout

from .nvme_state import state_value
from .partition import RankMajorLayout


class FragmentAccess:
    """Full and local views of one parameter's fragments (collective where it says so)."""

    def _gather_full(self, param: torch.nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """Collective: the full fp32 tensor of `param` from every rank's slot in `flat`."""
        frag = self.partition.fragments[param]
        return self._gather_slot(param, flat.detach()[frag.offset:frag.offset + frag.padded])

    def _gather_slot(self, param: torch.nn.Parameter, slot: torch.Tensor) -> torch.Tensor:
        """Collective: the full fp32 tensor of `param` from every rank's padded `slot` of it."""
        frag = self.partition.fragments[param]
        layout = RankMajorLayout([param], [frag.spec], self.comm.world_size)
        send = slot.float().contiguous().to(self.comm.device)
        out = torch.empty(layout.numel, dtype=torch.float32, device=send.device)
        self.comm.all_gather(out, send)
        full = torch.empty(param.shape, dtype=torch.float32, device=send.device)
        layout.unpack(out, [full])
        return full

    def owns(self, param: torch.nn.Parameter) -> bool:
        return param in self.partition.fragments

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        if self.nvme is None:
            return self._gather_slot(param, self.partition.store.slot(param))
        # With the optimizer on NVMe a rank's store can refuse its slot alone (partition_store.py's note: a
        # refused image): the ranks agree first (one element), so none is left waiting in the gather
        try:
            slot, refused = self.partition.store.slot(param), None
        except OffloadIOError as err:
            slot, refused = None, err
        flag = self.comm.zeros()
        flag += 0 if refused is None else self.comm.rank + 1
        self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if refused is not None:
            raise refused
        if float(flag):
            raise OffloadIOError(f"rank {int(flag) - 1} refused to read its rows of this parameter (its own error "
                                 "says why: zero_optimization.offload_optimizer.nvme_path); load a checkpoint to go on")
        return self._gather_slot(param, slot)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The reduced, averaged, unscaled gradient (valid between backward at the boundary and step)."""
        grad = self._gather_slot(param, self._grad_slot(param))
        return grad / self.guard.scaler.loss_scale

    def _grad_slot(self, param: torch.nn.Parameter) -> torch.Tensor:
        """`param`'s padded slot of the partition gradient: in memory, or read from its swap file."""
        if self.grad_swap is not None:
            return self.grad_swap.slot(self.partition.fragments[param])
        return self.partition.slot(param, self.partition.flat_grad)

    def full_optimizer_state(self, param: torch.nn.Parameter, name: str):
        key = self.partition.fragments[param].key
        flat = self.partition.flat[key]
        value = self.optimizer.state.get(flat, {}).get(name) if self.nvme is None else state_value(self.nvme, key, name)
        if value is not None and self._per_element(name):
            return self._gather_full(param, value)
        # Per-tensor state (e.g. Adam's step) or absent; a copy, since the optimizer updates it in place.
        return value.clone() if isinstance(value, torch.Tensor) else value

    def _per_element(self, name: str) -> bool:
        """Whether state `name` is one value per element: the optimizer's declaration (ops/state_layout.py;
        stages >= 1 refuse an optimizer without one), not its shape."""
        return (declared_layout(self.optimizer) or {}).get(name) == ELEMENTWISE

    def local_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's rows of `param`'s fp32 master (a copy, shaped as the rows; no collective)."""
        frag = self.partition.fragments[param]
        return self.partition.store.read(frag.key, frag.offset, frag.offset + frag.numel).view(frag.shape).clone()

    def local_optimizer_state(self, param: torch.nn.Parameter, name: str):
        frag = self.partition.fragments[param]
        flat = self.partition.flat[frag.key]
        value = self.optimizer.state.get(flat, {}).get(name) if self.nvme is None else state_value(self.nvme, frag.key, name)
        if value is not None and self._per_element(name):
            return value.detach()[frag.offset:frag.offset + frag.numel].view(frag.shape).clone()
        return value.clone() if isinstance(value, torch.Tensor) else value


