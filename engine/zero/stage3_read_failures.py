"""ZeRO-3: a parameter read that fails on some ranks only ends the pass on every rank, together.

[Note: a failed read rides in the tag] With `offload_param.device: "nvme"` each gather's send buffer is
read from the rank's parameter files (offload/param_swap.py), and a read can fail on one rank only (EIO,
a short read, a file changed underneath). Raised there, before its all-gather, it left the other ranks
waiting in that all-gather until the process group's timeout (30 min by default) or forever, and the
failing rank's next collectives matched none of theirs. So the failing rank sends anyway: zeros for its
chunks and the group's tag (stage3_params.py, note: tags) marked failed (`failed_tag`: its first element
-1 - id // 256, negative, exact in fp16, bf16 and fp32). Nothing is added to a gather that did not fail:
no collective, no element, no host read; the tags are read where they are checked anyway:
- at once, where the ids are read at every gather (the training pass that records the order, and
  gathers outside passes: GatheredParameters, saving, a pipeline's hold_all): every rank sees the mark
  in the same gather; outside a pass they raise right there;
- on the device in other passes (prefetch.py, note: no host reads per unit), read at the pass's end.
  Only the failing rank knows before: its flag (`flag`) rides in the all-reduce that ends a plan pass's
  forward anyway (one float64 more: rank and group), so a failure in forward is raised there.
Until it is raised, every rank runs on with what was gathered (the failing rank's chunk zeros, the same
everywhere: every rank runs the same modules and collectives). Then each ends the pass without owing a
gather (prefetch.py's `_fail_pass`: the plan's gathers issued up to the most any rank issued, every
gather drained, every group released, the reads issued ahead dropped: a failed one would fail the next
pass) and raises: the failing rank its own OffloadIOError (naming the file), the others `PeerReadError`.
The batch is dropped: raised at the end of forward, no gradient was made; raised at the end of backward,
the gradients of the accumulation window (the failed pass's among them) are dropped (stage3.py), so no
step applies them. Training on gathers from the files again; a checkpoint load works as ever.
"""
from __future__ import annotations

import torch


class PeerReadError(RuntimeError):
    """Another rank failed to read its parameters from NVMe; every rank ended the pass (module note)."""


class PeerStepError(RuntimeError):
    """Another rank's optimizer step failed (its swap files); every rank undid its step (stage3.py's note:
    a step failed on some rank)."""


def ranks_named(ranks: list[int]) -> str:
    """'rank 1', 'ranks 0, 2': every rank an error is about."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def undo_for_peers(nvme, stage: int, ranks: list[int]) -> PeerStepError:
    """Undo this rank's applied step because `ranks`' failed (nvme_tier.py's `revert_step`; stage3.py's and
    partitioned.py's notes: a step failed on some rank); the error every such rank raises."""
    nvme.revert_step()
    what = ("this rank's step, written in place (offload_optimizer.swap_slots 1) or fast_init's first step, "
            "cannot be undone: load a checkpoint to go on" if nvme.unrestored else "every rank undid this step and dropped its gradients: "
            "train on without this batch, or load a checkpoint")
    return PeerStepError(f"ZeRO-{stage}: {ranks_named(ranks)}'s optimizer step failed (zero_optimization."
                         f"offload_optimizer.nvme_path; that rank's own error names the file); {what}")


def failed_tag(gid: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tag a rank whose read failed sends in place of [gid // 256, gid % 256] (module note)."""
    return torch.tensor([-1 - gid // 256, gid % 256], dtype=dtype, device=device)


class ReadFailures:
    """What this rank knows of failed parameter reads in the current pass (module note)."""

    def __init__(self, rank: int, world: int, groups: list):
        self.rank, self.world, self.groups = rank, world, groups
        self.mine: BaseException | None = None  # this rank's own error
        self.mine_gid = -1  # the group it was reading for
        self.ranks: dict[int, int] = {}  # rank -> group id, of the failures every rank knows of
        self.raised: BaseException | None = None  # the last error raised (stage3.py drops the window on it)

    def clear(self) -> None:
        self.mine, self.ranks = None, {}

    def note_mine(self, g, err: BaseException) -> None:
        """This rank's read for group `g` failed: sent marked (GatherGroup.send_buffer)."""
        if self.mine is None:
            self.mine, self.mine_gid = err, g.gid
        if self.world == 1:  # no other rank to tell
            self.ranks.setdefault(self.rank, g.gid)

    def note_ids(self, ids: list[int]) -> bool:
        """Ids read from a gather's tags (one per rank): note the failed ones; whether any failed."""
        for r, i in enumerate(ids):
            if i < 0:  # failed_tag's [-1 - gid // 256, gid % 256] read as hi * 256 + lo
                self.ranks.setdefault(r, (-1 - i // 256) * 256 + i % 256)
        return any(i < 0 for i in ids)

    def flag(self) -> float:
        """This rank's failure for the end-of-forward all-reduce: 1 + rank + world * group id, or 0."""
        return 0.0 if self.mine is None else float(1 + self.rank + self.world * self.mine_gid)

    def note_flag(self, value: float) -> None:
        """The all-reduce's maximum of `flag` over the ranks."""
        if value > 0:
            k = int(value) - 1
            self.ranks.setdefault(k % self.world, k // self.world)

    @property
    def known(self) -> bool:
        """Every rank knows of a failure (its tags were read, or the flag reduced): raise now."""
        return bool(self.ranks)

    def error(self, in_backward: bool, in_pass: bool = True) -> BaseException:
        """What this rank raises (module note); forgets the pass's failures and the reads issued ahead."""
        self._drop_reads_ahead()
        if self.mine is not None:
            err = self.mine
        else:
            rank, gid = min(self.ranks.items())
            if not in_pass:
                what = "every rank stopped at this gather: the group was not gathered"
            elif in_backward:
                what = ("every rank ended this backward and dropped this accumulation window's gradients: "
                        "the step was not applied")
            else:
                what = "every rank ended this forward: its batch is dropped, no gradient was made"
            err = PeerReadError(
                f"ZeRO-3: rank {rank} failed to read its parameters of module '{self.groups[gid].name}' from its NVMe "
                f"parameter files (zero_optimization.offload_param.nvme_path; rank {rank}'s own error names the "
                f"file); {what}. Its error says how to go on: after a failed read train on (the gathers read the "
                f"files again), after a failed step whose parameters it refuses load a checkpoint")
        self.clear()
        self.raised = err
        return err

    def _drop_reads_ahead(self) -> None:
        """A read issued ahead that failed too would fail the next pass's gather: every one goes."""
        sources = self.groups[0].sources if self.groups else None
        for owner in (sources.partition.store, sources.frozen) if sources is not None else ():
            drop = getattr(owner, "drop_reads_ahead", None)  # the NVMe store, frozen chunks in a file
            if drop is not None:
                drop()
