"""ZeRO-3 inside a pipeline stage, as torchtitan composes FSDP with its pipeline schedules.

[Note: one gather per step] Stage 3 normally gathers a unit around each forward and backward and
reduce-scatters its gradients as backward produces them (zero/prefetch.py, zero/stage3.py). A
schedule runs every stage once per micro-batch, so that would gather and reduce m times per step. So
for the schedule's run every partitioned group of this stage is gathered once, over its data axis,
before the first micro-batch (`hold`: the stage-3 hooks do nothing while held), kept through all m
forwards and backwards, and released after the last backward (`release`), once the accumulated
gradients were reduce-scattered (once, after the last micro-batch: the ZeRO-1/2 route,
engine/pipe/reduction.py). Between steps each rank holds its 1/data of the stage's parameters; during
the schedule the stage's parameters in full, as torchtitan's `reshard_after_forward=False`.
"""
from __future__ import annotations


def _coordinator(zero_optimizer):
    return getattr(zero_optimizer, "coordinator", None)  # only stage 3 has one


def hold(zero_optimizer) -> None:
    """Gather this stage's parameters for the whole schedule run (module note); not stage 3: nothing."""
    coordinator = _coordinator(zero_optimizer)
    if coordinator is not None and not coordinator.held:
        coordinator.hold_all()


def release(zero_optimizer) -> None:
    """After the last backward (and the reduction) or an evaluation: back to this rank's partition."""
    coordinator = _coordinator(zero_optimizer)
    if coordinator is not None:
        coordinator.release_all()
