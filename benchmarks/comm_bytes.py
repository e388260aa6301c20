"""Bytes communicated per rank and step, one convention for every system in the suite's column:
**the bytes one rank sends**, computed from each collective's payload and its group's size n.

Each counter records a payload per (collective kind, group size), and `bytes_sent` applies the
formula of the algorithm torch's backends use for that kind (ring or tree; NCCL and gloo alike):

| kind | payload | bytes a rank sends |
|---|---|---|
| all_reduce | the buffer S | 2(n−1)/n · S (ring: a reduce-scatter, then an all-gather) |
| reduce_scatter | its full input S | (n−1)/n · S |
| all_gather | its full output S | (n−1)/n · S |
| reduce, broadcast | the buffer S | (n−1)/n · S on average over the group (all but the root send or receive S once) |
| all_to_all | its input S | (n−1)/n · S (a rank keeps its own chunk) |
| send | the tensor | S (recv: 0) |

So data parallelism over 2 ranks sends Ψ bytes of gradient per step whether it all-reduces them (DDP,
ZeRO-0) or reduce-scatters them and all-gathers the parameters (ZeRO-1/2): the ZeRO paper's equal
volume for stages 0-2. The counters, and what each one's raw number is:

- dstrain's `Communicator` (engine/comm.py, `stats.bytes[op]`): the payload above, per op, over its
  group (`comm.world_size`); gloo's reduce-scatter as one reduce per owner is still counted once, as
  the reduce-scatter it is (the same bytes sent).
- `DispatchBytes`: a dispatch mode that sees every c10d op called from Python (FSDP2's collectives,
  dstrain's pipeline sends and tensor-parallel layers, which use communicators of their own), with the
  group size read from the op's process group. torch's `CommDebugMode` sees the same ops but counts
  calls, not bytes. The mode intercepts every tensor op, so it is used only where no counter of the
  system's own exists, and a row timed under it says so (suite_runners.COUNTED_BY).
- `count_ddp_buckets`: DDP's reducer calls the process group from C++, past any dispatch mode, so its
  bytes are counted in a comm hook around torch's default all-reduce hook (each bucket once).
- DeepSpeed's `comms_logger` (deepspeed/comm/comm.py `timed_op`, utils.get_msg_size_from_args): the
  size of the op's argument named `tensor` (or `input_list`, `tensors`): the buffer for all_reduce,
  reduce and broadcast, the full input for reduce_scatter(_tensor), but for all_gather(_into_tensor)
  the *input*, one rank's shard, which is 1/n of the payload above. `deepspeed_logged_payloads`
  converts its record to the payloads here. Its record has no group size: the data-parallel world.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# kind -> the fraction of its payload one rank of an n-rank group sends (module table)
SENT_FRACTION = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                 "all_gather": lambda n: (n - 1) / n, "reduce": lambda n: (n - 1) / n,
                 "broadcast": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


def bytes_sent(payloads: dict[tuple[str, int], float]) -> float:
    """Bytes one rank sends for {(kind, group size): payload bytes} (module table)."""
    return sum(SENT_FRACTION[kind](n) * b for (kind, n), b in payloads.items())


def communicator_payloads(stats_bytes: dict[str, int], world: int) -> dict[tuple[str, int], float]:
    """dstrain's `Communicator.stats.bytes` over a group of `world` ranks, as payloads (no payload:
    all_gather_object's and barrier's 0)."""
    return {(op, world): b for op, b in stats_bytes.items() if op in SENT_FRACTION}


# c10d op -> (kind, the argument that holds the payload of the module table)
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
         "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0),
         "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
         "allgather_into_tensor_coalesced_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
         "reduce_scatter_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
         "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "send": ("send", 0)}
_NOT_SENT = {"recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(args) -> int | None:
    """The size of the process group a c10d op runs over (its argument is the group as a TorchScript
    object; ProcessGroup.unbox gives the Python one), or None when the op carries none."""
    import torch.distributed as dist
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(".ProcessGroup"):
            return dist.ProcessGroup.unbox(a).size()
    return None


class DispatchBytes(TorchDispatchMode):
    """`with DispatchBytes() as seen: ...`; then `seen.payloads` ({(kind, group size): bytes} of the c10d
    ops this rank called) and `seen.bytes` (what this rank sent: `bytes_sent`)."""

    def __init__(self):
        super().__init__()
        self.payloads: Counter = Counter()
        self.unknown: set[str] = set()  # c10d ops without a payload rule (reported, never guessed)

    @property
    def bytes(self) -> float:
        return bytes_sent(self.payloads)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            group = _group_size(args)
            if name in _C10D and len(args) > _C10D[name][1] and group is not None:
                kind, arg = _C10D[name]
                self.payloads[(kind, group)] += _nbytes(args[arg])
            elif name not in _NOT_SENT and not name.startswith("wait"):
                self.unknown.add(name)
        return func(*args, **(kwargs or {}))


def count_ddp_buckets(ddp_model, world: int) -> dict:
    """Register a counting all-reduce hook on `ddp_model`; the returned dict's "payloads" grows by each
    bucket's bytes as an all-reduce over `world` ranks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    seen = {"payloads": Counter()}

    def hook(state, bucket):
        seen["payloads"][("all_reduce", world)] += _nbytes(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)
    ddp_model.register_comm_hook(None, hook)
    return seen


# DeepSpeed comms_logger record name -> (kind, the factor from its logged size to the payload above
# as a function of n: its all-gathers log one rank's input shard); names that send nothing map to None.
_DEEPSPEED = {"all_reduce": ("all_reduce", 1), "reduce": ("reduce", 1), "broadcast": ("broadcast", 1),
              "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
              "all_gather": ("all_gather", "n"), "all_gather_into_tensor": ("all_gather", "n"),
              "all_to_all_single": ("all_to_all", 1), "all_to_all": ("all_to_all", 1),
              "send": ("send", 1), "isend": ("send", 1)}
_DEEPSPEED_NOT_SENT = {"recv", "irecv", "barrier", "log_summary_barrier", "monitored_barrier", "all_gather_object",
                       "broadcast_object_list"}


def deepspeed_logged_payloads(logged: dict[str, float], world: int) -> tuple[dict[tuple[str, int], float], set[str]]:
    """DeepSpeed's comms_logger record ({name: logged bytes}) as payloads over `world` ranks, and the
    names it has no rule for (batch_isend_irecv sums sends and receives: not guessed)."""
    payloads, unknown = Counter(), set()
    for name, b in logged.items():
        if name in _DEEPSPEED:
            kind, factor = _DEEPSPEED[name]
            payloads[(kind, world)] += b * (world if factor == "n" else factor)
        elif name not in _DEEPSPEED_NOT_SENT:
            unknown.add(name)
    return dict(payloads), unknown
