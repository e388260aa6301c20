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

[Note: one id check] An on-demand gather is preceded by a fixed-size all-gather of the group's id
(zero/prefetch.py's note), so that ranks about to gather different groups — rank-divergent control
flow, whose data all-gathers would differ in size and hang or mix bytes — fail with both modules named.
`hold` gathers every group of the stage in the coordinator's fixed order, with no branch between two
gathers: once the data ranks agree on the first group, the rest follow in lockstep. So only the first
gather is checked (a rank that entered the step while another gathered some other group, in
GatheredParameters say, is caught there); the rest skip the id all-gather (`check=False`), their data all-gathers still carrying and
checking each group's tags. Per step: one id all-gather plus one data all-gather per group.
"""
from __future__ import annotations

from offload.aio import OffloadIOError

from ..zero.stage3_read_failures import PeerReadError


def _coordinator(zero_optimizer):
    return getattr(zero_optimizer, "coordinator", None)  # only stage 3 has one


def hold(zero_optimizer) -> BaseException | None:
    """Gather this stage's parameters for the whole schedule run (module note); not stage 3: nothing.
    Returns the error of a persistent parameters' refresh that failed after the last step and again now
    (zero/stage3.py's note: a failed persistent read), or of a gather's read failing on a rank of the data
    group: the caller keeps it as its stage's failure, so the schedule runs (on the persistent parameters
    from before the step; on zeros for the groups not gathered) and every rank drops the batch after it
    (stage_failure.py's note), where raising here would leave the other stages in the schedule."""
    coordinator = _coordinator(zero_optimizer)
    if coordinator is None or coordinator.held:
        return None
    failed = None
    if coordinator.before_pass is not None:  # the retry a pass's first hook makes: held hooks do nothing
        try:
            coordinator.before_pass()
        except (OffloadIOError, PeerReadError) as err:  # every rank of the data group raised it
            failed = err
    try:
        coordinator.gather_now(coordinator.groups[:1])  # with the id check (module note: one id check)
        coordinator.hold_all(check=False)
    except (OffloadIOError, PeerReadError) as err:  # a gather's read failed: every rank of the data group
        for g in coordinator.groups:  # raised at it (stage3_read_failures.py); zeros stand in for the groups
            if not g.gathered:  # not gathered, so the schedule runs on shapes it can send (the batch is
                g.unpack(g.output_buffer().zero_())  # dropped after it)
        coordinator.held = True
        return err
    return failed


def release(zero_optimizer) -> None:
    """After the last backward (and the reduction) or an evaluation: back to this rank's partition."""
    coordinator = _coordinator(zero_optimizer)
    if coordinator is not None:
        coordinator.release_all()
