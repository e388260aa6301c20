"""Which process group a tensor-parallel layer splits over, as a `Communicator` (so every collective
is counted and device-checked like the rest of the engine's, engine/comm.py).

A layer takes `group=` explicitly; without one it uses the current topology's model group
(`engine.topology.current()`, built by `initialize` from `tensor_parallel.autotp_size`). One
communicator per group, so the byte counts of every layer on a group add up in one place.
"""
from __future__ import annotations

import torch.distributed as dist

from ..comm import Communicator

_COMMS: dict[int, Communicator] = {}


def _current_model_group() -> dist.ProcessGroup | None:
    try:
        from ..topology import current
    except ImportError:  # the topology module arrives with the pipeline branch
        current = None
    topology = current() if current is not None else None
    if topology is None:
        raise RuntimeError("tensor-parallel layer without a group: pass group= (a torch.distributed ProcessGroup), "
                           "or build it after engine.initialize() with tensor_parallel.autotp_size in the config")
    return topology.model_group


def tensor_parallel_comm(group: dist.ProcessGroup | Communicator | None = None) -> Communicator:
    """The communicator of `group` (a ProcessGroup, a Communicator, or None: the topology's model group)."""
    if isinstance(group, Communicator):
        return group
    if group is None:
        group = _current_model_group()
    key = id(group)
    if key not in _COMMS:
        _COMMS[key] = Communicator(group)
    return _COMMS[key]


class ModelParallelUnit:
    """Megatron's `mpu` interface over one tensor-parallel communicator: what
    `engine.checkpointing.configure(mpu_=...)` and `model_parallel_cuda_manual_seed` read."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def get_model_parallel_group(self):
        return self.comm.group

    def get_model_parallel_rank(self) -> int:
        return self.comm.rank

    def get_model_parallel_world_size(self) -> int:
        return self.comm.world_size
