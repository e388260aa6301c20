"""ZeRO-3 on-demand gathers by request, for passes in which every rank gathers on demand: evaluation,
the training pass that records the order, and the rest of a pass in which a rank left the plan in
forward (prefetch.py's notes).

[Note: gathering by request] Each rank runs the units its data takes it to: an MoE expert no token of
this rank chose is not called here, but may be on another rank. So a rank cannot know which
all-gathers the others will issue. Each on-demand gather is therefore a *round*: every rank all-gathers
the id of the group it needs next (or DONE) and reads them; then all ranks gather every group
requested in that round, in id order, and a rank keeps only the one it asked for. A rank whose pass
(or backward, before it waits on gradient reductions) has no gathers left keeps answering rounds with
DONE, serving the other ranks' gathers, until every rank sent DONE. Every rank thus issues the same
collectives in the same order whatever each one runs, and each computes exactly what it would alone.
The price is one host read of the ids per gather (a GPU's run-ahead stops there), which training
passes on the plan avoid. A collective of the model's own (an all-to-all) between two units that only
some ranks run is not covered: that rank waits in it while the others wait in a round; the
process-group timeout names the module the waiting round was for.
"""
from __future__ import annotations

import torch

DONE = -1  # the id a rank sends once its pass has no gathers left


class RankDivergenceError(RuntimeError):
    """The ranks ran different modules where stage 3 needs them to agree (prefetch.py's note)."""


class RequestRounds:
    def __init__(self, coordinator):
        self.co = coordinator
        self.mixed = False  # a round of this pass served a group some rank did not ask for (all ranks agree)

    def gather(self, g) -> None:
        """Gather group `g` for this rank, serving whatever the other ranks need in the same round."""
        if self.co.comm.world_size == 1:
            self._serve(g, wanted=True)
            return
        for gid in self._round(g.gid, g.name):
            self._serve(self.co.groups[gid], wanted=gid == g.gid)

    def close(self) -> None:
        """This rank's pass has no gathers left: serve the others' until every rank is done."""
        if self.co.comm.world_size == 1:
            return
        while True:
            wanted = self._round(DONE, "<end of pass>")
            if not wanted:
                return
            for gid in wanted:
                self._serve(self.co.groups[gid], wanted=False)

    def _round(self, gid: int, name: str) -> list[int]:
        """Every rank's request (one fixed-size all-gather, read here): the distinct groups, in id order."""
        comm = self.co.comm
        mine = comm.zeros(1, dtype=torch.int64).fill_(gid)
        out = comm.empty(comm.world_size, dtype=torch.int64)
        try:
            comm.all_gather(out, mine)
        except RuntimeError as e:
            raise RankDivergenceError(f"ZeRO-3: rank {comm.rank} timed out agreeing on the next gather (it needs "
                                      f"'{name}'): another rank waits in a collective that this one does not run "
                                      f"at this point ({e})") from e
        asked = set(out.tolist())
        self.mixed |= len(asked) > 1  # the same on every rank: each read the same ids
        return sorted(asked - {DONE})

    def _serve(self, g, wanted: bool) -> None:
        """Gather `g` now; the parameters get the result only if this rank asked for it."""
        self.co._issue(g)
        self.co._finish(g, unpack=wanted)
