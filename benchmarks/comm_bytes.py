"""Bytes communicated per rank, counted where each system's collectives actually pass, for the suite's
bytes/step column. Payload bytes, as engine/comm.py's counter records them (all-reduce: the tensor;
reduce-scatter: its full input; all-gather: its full output; point-to-point: what was sent):

- `DispatchBytes`: a dispatch mode that sees every `torch.distributed` collective called from Python
  (FSDP2's, and dstrain's pipeline sends and tensor-parallel layers, which use communicators of their
  own). torch's `CommDebugMode` sees the same ops but counts calls, not bytes.
- `count_ddp_buckets`: DDP's reducer calls the process group from C++, past any dispatch mode, so its
  bytes are counted in a comm hook around torch's default all-reduce hook (each bucket once).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> the argument that holds the full payload (a tensor or a list of them).
_PAYLOAD_ARG = {"allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "_allgather_base_": 0,
                "allgather_": 0, "allgather_into_tensor_coalesced_": 0, "_reduce_scatter_base_": 1,
                "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_base_": 1, "alltoall_": 1,
                "send": 0, "reduce_": 0, "gather_": 1, "scatter_": 1}
_NOT_SENT = {"recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class DispatchBytes(TorchDispatchMode):
    """`with DispatchBytes() as sent: ...`; then `sent.bytes` (payload bytes of c10d ops on this rank)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.unknown: set[str] = set()  # c10d ops without a payload rule (reported, never guessed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            if name in _PAYLOAD_ARG and len(args) > _PAYLOAD_ARG[name]:
                self.bytes += _nbytes(args[_PAYLOAD_ARG[name]])
            elif name not in _NOT_SENT and not name.startswith("wait"):
                self.unknown.add(name)
        return func(*args, **(kwargs or {}))


def count_ddp_buckets(ddp_model) -> dict:
    """Register a counting all-reduce hook on `ddp_model`; the returned dict's "bytes" grows per bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    sent = {"bytes": 0}

    def hook(state, bucket):
        sent["bytes"] += _nbytes(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)
    ddp_model.register_comm_hook(None, hook)
    return sent
