"""Muon's swapped step (`"type": "Muon"` with `offload_optimizer.device: "nvme"`), its host memory
bounded by the swap pool and the largest matrix rather than by the rank's partition.

Muon's momentum is elementwise, but Newton-Schulz needs each matrix whole, on the matrix's owner rank
(per_tensor.OwnerOrthogonalizer). For every matrix flat (a `use_muon` group):

- pass 1 reads each sub-group's momentum, advances it and writes it back (to the slot `commit` makes
  current: offload/swapped_partition.py's two-slots note);
- pass 2 reads the master sub-group by sub-group. Before sub-group k is updated, the *rounds* that reach
  into it run. A round is a run of consecutive matrices of the flat whose whole sizes add up to at most
  the pool's capacity (`buffer_count` x buffer elements); a matrix larger than that is a round alone,
  since a matrix can only be orthogonalised whole. A round reads its range of the momentum pass 1
  wrote (read only), forms U = G.lerp(m, β) from it sub-group by sub-group — the operation the
  in-memory step does, on the same values, so the same bits — and sends it through the owners' two
  all-to-alls; what comes back is the round's orthogonalised update, applied by pass 2 and dropped once
  pass 2 has gone past it. Each rank derives the same rounds from the shapes and the pool (the flats'
  sizes and offsets are equal on every rank), so the collectives pair up.
The AdamW half is elementwise: the ordinary swapped step (nvme_tier.py).

[Note: memory] With W the whole-matrix elements of a round (W <= max(pool capacity, largest matrix)),
a round holds, in fp32: U of this rank's fragments (about W/world), the all-to-all send and receive
buffers (world x the largest owner's block: at most W each, plus padding), and on the owner its whole
matrices and their results (at most W each), plus Newton-Schulz's temporaries of one matrix (about four
of its size). Pass 2 keeps at most the last round's tail that reaches into the current sub-group.
None of it grows with the partition; the momentum, the master and the gradient stay in the files (the
gradient is read one sub-group at a time, grad_swap.py: in pass 1 and again where a round forms U).
tests/test_optimizer_set.py measures the peak of the step's tensor allocations with torch's profiler.
The price: the momentum and the gradient are read twice per step (passes 1 and 2), and a flat with R
rounds takes 2R all-to-alls instead of 2.
"""
from __future__ import annotations

from bisect import bisect_right

import torch

from ops.muon import apply_muon_update, muon_cost

from .per_tensor import OwnerOrthogonalizer, assign_owners

CPU = torch.device("cpu")
MASTER, MOMENTUM = "master", "momentum_buffer"


def muon_rounds(matrices: list, sizes: list[int], capacity: int) -> list[list]:
    """Consecutive runs of `matrices` whose `sizes` add up to at most `capacity` (one matrix at least)."""
    rounds, total = [], 0
    for p, size in zip(matrices, sizes):
        if rounds and total + size <= capacity:
            rounds[-1].append(p)
            total += size
        else:
            rounds.append([p])
            total = size
    return rounds


class _Round:
    """The matrices of one round, the flat ranges [start, end) their fragments lie in (per flat key),
    and their orthogonaliser."""

    def __init__(self, ranges: dict, orthogonalizer: OwnerOrthogonalizer):
        self.ranges, self.orthogonalizer = ranges, orthogonalizer


class SwappedMuon:
    """Muon's bounded two-pass swapped step (module docstring)."""

    def __init__(self, tier, zopt):
        self.tier, self.partition, self.optimizer = tier, zopt.partition, zopt.optimizer
        groups = self.optimizer.param_groups
        self.matrix_keys = [key for key in tier.parts if groups[key[0]]["use_muon"]]
        self.rounds = self._rounds(zopt.comm, tier.pool.buffer_count * tier.pool.buffer_size)

    def _rounds(self, comm, capacity: int) -> list[_Round]:
        """Rounds over the matrices of every matrix flat in order; a flat's gaps go with the round
        before them, its tail with its last matrix's round."""
        fragments = self.partition.fragments
        order = [p for key in self.matrix_keys
                 for p in sorted(self.partition.members[key], key=lambda p: fragments[p].offset)]
        last_of = {fragments[p].key: p for p in order}
        covered = dict.fromkeys(self.matrix_keys, 0)
        sizes = [fragments[p].spec.rows * fragments[p].spec.row_numel for p in order]
        # owners over all matrices, as without offload: rounds bound memory, not the Newton-Schulz balance
        owner = dict(zip(order, assign_owners([muon_cost(fragments[p].spec.rows, fragments[p].spec.row_numel)
                                               for p in order], comm.world_size)))
        rounds = []
        for run in muon_rounds(order, sizes, capacity):
            ranges = {}
            for p in run:
                frag = fragments[p]
                end = self.tier.parts[frag.key].numel if last_of[frag.key] is p else frag.offset + frag.padded
                ranges[frag.key] = (ranges[frag.key][0] if frag.key in ranges else covered[frag.key], end)
                covered[frag.key] = end
            muon_groups = {key[0] for key in ranges}
            rounds.append(_Round(ranges, OwnerOrthogonalizer(self.partition, comm, muon_groups,
                                                             self.optimizer.ns_dtype, matrices=run,
                                                             owners=[owner[p] for p in run])))
        return rounds

    def step(self) -> None:
        """Both passes over the matrix flats, then the AdamW half. A rank whose step fails still enters
        every round it has not entered before it raises (`_enter_with_zeros`' note)."""
        groups = self.optimizer.param_groups
        pending = list(self.rounds)  # the rounds this rank has not entered yet
        try:
            for key in self.matrix_keys:
                self._momentum_pass(key, self.tier.parts[key], groups[key[0]])
            ready = {key: [] for key in self.matrix_keys}  # key -> [(start, end, orthogonalised update)]
            for key in self.matrix_keys:
                self._apply_pass(key, self.tier.parts[key], groups[key[0]], pending, ready)
        except Exception:  # noqa: BLE001 - raised once this rank has entered every round
            self._enter_with_zeros(pending)
            raise
        for key, part in self.tier.parts.items():
            if key not in self.matrix_keys:
                self.tier.step_elementwise(key, part)

    def join_as_failed(self) -> None:
        """This rank refused its step before it began (nvme_tier.py's `check_image`): enter every round."""
        self._enter_with_zeros(self.rounds)

    def _enter_with_zeros(self, rounds: list[_Round]) -> None:
        """[Note: a rank whose step fails] A rank whose swap read or write fails (or which refuses its
        step) does not reach the rounds after the failure, while the other ranks wait in their all-to-alls;
        so it still enters each of them, sending zeros for its fragments. The other ranks apply a step from
        those, which the stage's agreement after the step undoes on every rank, as any step that failed on
        one rank (partitioned.py's and stage3.py's notes: a step failed on some rank): every rank raises,
        the failing one its own error, the others PeerStepError. Nothing is added to a step that does not
        fail: no collective, no host read. A failure after the last round owes nothing."""
        for round_ in rounds:
            keys = list(round_.ranges)
            zeros = [torch.zeros(b - a, dtype=torch.float32, device=CPU) for a, b in round_.ranges.values()]
            round_.orthogonalizer([self.partition.flat[key] for key in keys], zeros,
                                  starts=[round_.ranges[key][0] for key in keys])

    def _momentum_pass(self, key, part, group: dict) -> None:
        grad, beta = self.tier.grad_reader(key), group["momentum"]  # from the swap file (grad_swap.py)

        def visit(k: int, views: dict) -> None:
            s, e = part.groups[k]
            views[MOMENTUM].lerp_(grad(s, e), 1 - beta)  # m <- β·m + (1−β)·G (ops.muon.nesterov_momentum)
        read = {MOMENTUM: part.source_slot} if part.has_state else {}
        part.sweep(visit, read, write=[MOMENTUM])

    def _apply_pass(self, key, part, group: dict, pending: list, ready: dict) -> None:
        store, windows = self.partition.store, ready[key]

        def visit(k: int, views: dict) -> None:
            s, e = part.groups[k]
            while pending and (not windows or windows[-1][1] < e):
                self._run_round(pending, ready)
            pieces = [u[max(s, a) - a:min(e, b) - a] for a, b, u in windows if a < e and b > s]
            apply_muon_update(views[MASTER], pieces[0] if len(pieces) == 1 else torch.cat(pieces), group)
            store.write_behind(key, s, views[MASTER])
            while windows and windows[0][1] <= e:
                windows.pop(0)
        part.sweep(visit, {MASTER: part.source_slot}, write=[MASTER])
        part.commit([{} for _ in part.groups])

    def _run_round(self, pending: list[_Round], ready: dict) -> None:
        """The first pending round's orthogonalised updates, appended to `ready`: U from the momentum pass
        1 wrote, orthogonalised through the owners. The round leaves `pending` once its reads are done:
        one that fails leaves it owed (note: a rank whose step fails)."""
        round_, keys = pending[0], list(pending[0].ranges)
        updates = [self._nesterov(key, *round_.ranges[key]) for key in keys]
        pending.pop(0)
        round_.orthogonalizer([self.partition.flat[key] for key in keys], updates,
                              starts=[round_.ranges[key][0] for key in keys])
        for key, update in zip(keys, updates):
            ready[key].append((*round_.ranges[key], update))

    def _nesterov(self, key, a: int, b: int) -> torch.Tensor:
        """U = G.lerp(m, β) of flat `key`'s elements [a, b), from the momentum pass 1 wrote."""
        part, beta = self.tier.parts[key], self.optimizer.param_groups[key[0]]["momentum"]
        grad = self.tier.grad_reader(key)  # read again: the same bits the momentum pass read
        update = torch.empty(b - a, dtype=torch.float32, device=CPU)
        starts = [s for s, _ in part.groups]

        def visit(k: int, views: dict) -> None:
            s, e = part.groups[k]
            lo, hi = max(s, a), min(e, b)
            # over the whole sub-group, as the in-memory step: SIMD lanes as there (nvme_tier.py's lanes note)
            nesterov = grad(s, e).lerp(views[MOMENTUM], beta)
            update[lo - a:hi - a].copy_(nesterov[lo - s:hi - s])
        first, last = bisect_right(starts, a) - 1, bisect_right(starts, b - 1) - 1
        part.sweep(visit, {MOMENTUM: 1 - part.source_slot}, write=[], groups=range(first, last + 1))
        return update
