"""Which process group a tensor-parallel layer splits over, as a `Communicator` (so every collective
is counted and device-checked like the rest of the engine's, engine/comm.py).

A layer takes `group=` explicitly; without one it uses the current topology's model group
(`engine.topology.current()`, which `initialize` sets from `tensor_parallel.autotp_size`; with no
topology set, a model axis of one rank: the layer is then the dense one). Layers built by one call
(AutoTP's `shard_model`) share one communicator, so their byte counts add up in one place.
"""
from __future__ import annotations

import torch.distributed as dist

from ..comm import Communicator


def tensor_parallel_comm(group: dist.ProcessGroup | Communicator | None = None) -> Communicator:
    """The communicator of `group` (a ProcessGroup, a Communicator, or None: the topology's model group)."""
    if isinstance(group, Communicator):
        return group
    if group is None:
        from ..topology import current
        group = current().model_group  # collective the first time (it creates the groups)
    return Communicator(group)


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
