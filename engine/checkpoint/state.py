"""What a checkpoint holds, read from and written back into a live engine.

Per-stage adapters turn a ZeRO optimizer's storage into per-parameter fragments (format.py's note)
and back, without the stages knowing about checkpoints:
- `DataParallelAdapter` (stage 0): every rank holds full tensors; rank r writes rows chunk r of every
  parameter, so all ranks share the writing, and loads all rows.
- `PartitionedAdapter` (stages 1-2, and any stage built on `zero.partition.PartitionedParams`): a rank
  writes and loads exactly its own `Fragment` of the flat fp32 partition and of the optimizer state.
- `Stage3Adapter` (stage 3, stage3.py): `PartitionedAdapter` with module parameters as placeholders.
A new stage plugs in by adding an adapter with the same methods and a line in `adapter_for`.

[Note: model weights] Trainable weights are not stored separately: after every step the model
weights are the fp32 master rows cast to the model dtype (stage 0 `MasterWeights.copy_to_model`,
stage 1/2 all-gather), so the reader rebuilds them from "fp32" bit for bit.
"""
from __future__ import annotations

import random

import torch

from ..zero.partition import ChunkSpec
from .format import FP32, MODULE  # noqa: F401 - re-exported for snapshot/reader
from .state_layout import elementwise_kinds


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """A view with dim 0 as rows (a 0-d tensor is one row)."""
    return t.reshape(1) if t.dim() == 0 else t


def row_kinds(optimizer) -> set[str]:
    """State names stored per element, as rows of their parameter (exp_avg, ...), as opposed to scalar
    state (step): the optimizer's declared layout (state_layout.py)."""
    return elementwise_kinds(optimizer)


def _split_state(state: dict, kinds: set[str], cut) -> dict:
    """One parameter's state: row kinds cut to this fragment by `cut(tensor)`, scalar state kept whole."""
    return {kind: cut(value.detach()) if kind in kinds else value for kind, value in state.items()}


class _WholeModule:
    """Defaults for stages whose module tensors are whole on every rank (all but stage 3)."""

    holds_module_weights = True  # restore.py copies the full fp32 rows (cast) into the parameter

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def entry_rows(self, t: torch.Tensor):
        """Frozen tensors/buffers are whole here: rank 0 writes them, every rank loads all rows."""
        return None

    def entry_rows_loaded(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        """`rows` (from `entry_rows`) now hold the loaded values."""


class DataParallelAdapter(_WholeModule):
    """Stage 0: full parameters, full fp32 masters (or the fp32 parameters), full optimizer state."""

    def __init__(self, zopt, rank: int, world: int):
        self.zopt, self.rank, self.world = zopt, rank, world
        masters = zopt.master
        self._owner = dict(zip(masters.model_params, masters.master_params)) if masters else {}

    def params(self) -> list[torch.nn.Parameter]:
        return list(self.zopt.params)

    def owner(self, p):
        return self._owner.get(p, p)

    def save_rows(self, p) -> tuple[int, int]:
        return ChunkSpec.of(p, self.world).row_range(self.rank)

    def load_rows(self, p) -> tuple[int, int]:
        return 0, rows_of(p).shape[0]

    def read(self, p, kinds: set[str]) -> dict:
        """This rank's fragment of `p`: views, kind -> tensor; `kinds` = row_kinds(optimizer)."""
        start, stop = self.save_rows(p)
        owner = self.owner(p)
        tensors = {FP32: rows_of(owner.detach())[start:stop]}
        state = self.zopt.optimizer.state.get(owner, {})
        tensors.update(_split_state(state, kinds, lambda t: rows_of(t)[start:stop]))
        return tensors

    def begin_load(self, load_state: bool) -> None:
        if load_state:
            for p in self.params():
                self.zopt.optimizer.state.pop(self.owner(p), None)

    @torch.no_grad()
    def write(self, p, tensors: dict, load_state: bool) -> None:
        owner = self.owner(p)
        if owner is not p:
            owner.copy_(tensors[FP32].view_as(owner))
        if not load_state:
            return
        state = {}
        for kind, value in tensors.items():
            if kind == FP32:
                continue
            if isinstance(value, torch.Tensor):
                rows = value.dim() > 0 and value.numel() == owner.numel()
                device = state_device(self.zopt.optimizer, owner, kind, rows)
                value = (value.reshape(owner.shape) if rows else value).clone().to(device)
            state[kind] = value
        if state:
            self.zopt.optimizer.state[owner] = state

    def finish_load(self) -> None:
        pass


class PartitionedAdapter(_WholeModule):
    """Stages 1-2: this rank's fragment of each parameter in the flat fp32 partitions."""

    def __init__(self, zopt, rank: int, world: int):
        self.zopt, self.rank, self.world = zopt, rank, world
        self.part = zopt.partition
        self._loaded_scalars: set = set()
        self._old_state: dict = {}

    def params(self) -> list[torch.nn.Parameter]:
        return self.part.params()

    def save_rows(self, p) -> tuple[int, int]:
        return self.part.fragments[p].spec.row_range(self.rank)

    load_rows = save_rows

    def _flat(self, p) -> torch.nn.Parameter:
        return self.part.flat[self.part.fragments[p].key]

    def read(self, p, kinds: set[str]) -> dict:
        frag, flat = self.part.fragments[p], self._flat(p)
        tensors = {FP32: self.part.store.read(frag.key, frag.offset, frag.offset + frag.numel).view(frag.shape)}
        state = self.zopt.optimizer.state.get(flat, {})
        tensors.update(_split_state(state, kinds, lambda t: t[frag.offset:frag.offset + frag.numel].view(frag.shape)))
        return tensors

    def begin_load(self, load_state: bool) -> None:
        self._loaded_scalars.clear()
        if load_state:
            for flat in self.part.flat.values():
                self._old_state[flat] = self.zopt.optimizer.state.pop(flat, None) or {}

    def _state_buffer(self, flat, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat-sized buffer for one kind of state: the one the optimizer had, where it had one
        (memory already resident: no page faults), else a new one."""
        old = self._old_state.get(flat, {}).get(kind)
        same = isinstance(old, torch.Tensor) and (old.shape, old.dtype, old.device) == (flat.shape, dtype, flat.device)
        return old.zero_() if same else torch.zeros_like(flat.detach(), dtype=dtype)

    @torch.no_grad()
    def write(self, p, tensors: dict, load_state: bool) -> None:
        frag, flat = self.part.fragments[p], self._flat(p)
        self.part.store.write(frag.key, frag.offset, tensors[FP32].reshape(-1))
        if not load_state:
            return
        state = self.zopt.optimizer.state.setdefault(flat, {})
        for kind, value in tensors.items():
            if kind == FP32:
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                # Padding slots stay zero (partition.py's note: they must, for the optimizer's math).
                # Zeroed once per flat and kind (not as setdefault's argument, evaluated per call:
                # that was a flat-sized zero fill per parameter, most of the load time).
                buf = state.get(kind)
                if buf is None:
                    buf = state[kind] = self._state_buffer(flat, kind, value.dtype)
                buf[frag.offset:frag.offset + frag.numel].copy_(value.reshape(-1))
            elif (flat, kind) not in self._loaded_scalars:
                if isinstance(value, torch.Tensor):
                    value = value.clone().to(state_device(self.zopt.optimizer, flat, kind, rows=False))
                state[kind] = value
                self._loaded_scalars.add((flat, kind))

    def finish_load(self) -> None:
        self._old_state = {}
        for flat in self.part.flat.values():  # a flat with no saved state keeps none (fresh optimizer)
            if not self.zopt.optimizer.state.get(flat):
                self.zopt.optimizer.state.pop(flat, None)


def adapter_for(zopt, rank: int, world: int):
    if zopt is None:
        return None
    if getattr(zopt, "stage", None) == 3:  # before the partition check: stage 3 has one too
        from .stage3 import Stage3Adapter, Stage3NvmeAdapter
        return (Stage3NvmeAdapter if getattr(zopt, "nvme", None) is not None else Stage3Adapter)(zopt, rank, world)
    if getattr(zopt, "nvme", None) is not None:  # stages 1-2 with optimizer state in swap files
        from .nvme import NvmeAdapter
        return NvmeAdapter(zopt, rank, world)
    if hasattr(zopt, "partition"):
        return PartitionedAdapter(zopt, rank, world)
    if getattr(zopt, "stage", None) == 0:
        return DataParallelAdapter(zopt, rank, world)
    raise NotImplementedError(f"checkpointing has no adapter for ZeRO stage {getattr(zopt, 'stage', '?')}")


def state_device(optimizer, param, kind: str, rows: bool) -> torch.device:
    """Where the optimizer keeps a loaded state value: with its parameter, except torch's `step` counters,
    which stay on the host unless the group is fused or capturable (torch's own load_state_dict rule): a
    step on the GPU would be read back (`.item()`, a host sync) for the bias correction at every step."""
    if rows or kind != "step":
        return param.device
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), {})
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


# -- RNG ------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """This rank's generators, as weights_only-loadable values (numpy's array becomes a tensor)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:
        pass
    if torch.cuda.is_available():
        # This rank's own device only (engine/dist.py binds it): all visible devices' states would not
        # load where a resumed rank sees fewer GPUs (one per task under SLURM).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_own_cuda_state(state["cuda"]))


def _own_cuda_state(saved) -> torch.Tensor:
    """The saved CUDA generator state for this rank's device; checkpoints before it was per rank held a
    list of every visible device's, in which this rank's device was the one it had bound."""
    if isinstance(saved, torch.Tensor):
        return saved
    return saved[min(torch.cuda.current_device(), len(saved) - 1)]
