"""`RecomputeProbe`: which aten ops a backward runs again inside checkpoint recomputes, how often, and
their CPU time — what a selective policy really saves in compute, op by op.

    with RecomputeProbe() as ops:
        model(x).backward()
    ops.counts["aten.addmm.default"], ops.seconds["aten.addmm.default"]

[Note: where it sits] The probe is a dispatch mode entered before the backward, so in each recompute
it lies under the mode torch's selective checkpoint pushes there: an op that policy kept is answered
from its cache and never reaches the probe; only ops that execute again do. It records only while a
recompute of `engine.checkpointing`'s checkpoints runs (`recomputing()`, entered by checkpoint.py), not
the backward's own ops. Times are this process's CPU time (`time.process_time`): on a shared machine
wall time is the neighbours'; run with one intra-op thread for it to be the op's own time.
"""
from __future__ import annotations

import collections
import contextlib
import time

from torch.utils._python_dispatch import TorchDispatchMode

_DEPTH = [0]  # >0 while a checkpoint's recompute runs


@contextlib.contextmanager
def recomputing():
    """Marks a checkpoint's recompute (checkpoint.py) for the probes."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


class RecomputeProbe(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _DEPTH[0]:
            return func(*args, **(kwargs or {}))
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        self.seconds[str(func)] += time.process_time() - start
        self.counts[str(func)] += 1
        return out

    def ops(self) -> set[str]:
        """The overload packets that ran again (`aten.addmm`, ...)."""
        return {name.rsplit(".", 1)[0] for name in self.counts}
