"""Lamb and Muon with their state in swap files (`offload_optimizer.device: "nvme"`, nvme_tier.py).

The swapped step sees one sub-group of `sub_group_size` elements at a time, and a sub-group holds
pieces of many tensors; Lamb's trust ratio needs norms over whole tensors and Muon's Newton-Schulz
whole matrices. Both are therefore stepped in two passes over the sub-groups (`SwappedPartition.sweep`),
committed together, so a failed or skipped step leaves the files as the last step wrote them:

- Lamb. Pass 1 reads master and moments, advances the moments (written back), forms the update u and
  adds each element's x² and u² into one vector of per-parameter partial sums; that vector is summed
  over ranks once per step (per_tensor.py's reduction, as without offload). Pass 2 reads the master
  and the moments pass 1 wrote, recomputes u from them (the same elementwise arithmetic, so the same
  bits: no u file, no extra disk), applies its tensor's clamped ratio and writes the master.
- Muon (nvme_muon.py): pass 1 advances the momentum; pass 2 applies each matrix's update, orthogonalised
  whole on its owner in rounds of matrices that fit the swap pool. The AdamW half is elementwise: the
  ordinary swapped step with an AdamW-only copy of the optimizer (nvme_tier.py).

[Note: memory] Lamb holds per sub-group its pool buffers and the sub-group's update, plus the 2·P
partial-sum vector (P parameters); nothing partition-sized beyond what the CPU tier holds anyway
(the host master flat; the gradient is read from its swap file one sub-group at a time: grad_swap.py).
Muon's bound is nvme_muon.py's memory note.
[Note: bits] Both equal the in-memory step bit for bit: every operation is elementwise except the
partial sums, and those receive each parameter's addends in the order the in-memory blocks add them
(ops/tensor_segments.py's rows note). Sub-groups are whole SIMD lane groups (nvme_tier.py).
"""
from __future__ import annotations

import torch

import ops
from offload.swapped_partition import MASTER
from ops.lamb import MOMENTS, advance_moments, advance_step, direction_from_moments, scaled_ratios

from .nvme_muon import SwappedMuon
from .per_tensor import all_reduce_sum, flat_runs
from .stage3_read_failures import PeerStepError, ranks_named

CPU = torch.device("cpu")


class SwappedLamb:
    """Lamb's two-pass swapped step (module docstring)."""

    def __init__(self, tier, zopt):
        self.tier, self.partition = tier, zopt.partition
        index = {p: i for i, p in enumerate(self.partition.params())}
        self.count, self.reduce, self.comm = len(index), all_reduce_sum(zopt.comm), zopt.comm
        # plans built per sub-group on demand (nothing held per flat element: memory note), on the host,
        # where the swapped sub-groups are stepped
        self.runs = {key: flat_runs(self.partition, key, index, cache=False, device=CPU) for key in tier.parts}

    def step(self) -> None:
        """The summed vector ends with one element per rank, 1 where its pass 1 failed: every rank still
        enters the sum (before, the others waited in it) and raises (ZeRO-3 agrees on the step's
        outcome too: stage3.py's note, a step failed on some rank)."""
        partial, failed = self._partial_sums(), None
        try:
            steps = {key: self._moments_pass(key, part, partial) for key, part in self.tier.parts.items()}
        except Exception as err:  # noqa: BLE001 - raised below, once every rank has summed
            failed = err
            self._mark_failed(partial)
        total = self.reduce(partial)
        if failed is not None:
            raise failed
        n = 2 * self.count
        ranks = [r for r, bad in enumerate(total[n:].tolist()) if bad]
        if ranks:
            raise PeerStepError(f"ZeRO: {ranks_named(ranks)}'s optimizer step failed before Lamb's second pass (zero_"
                                "optimization.offload_optimizer.nvme_path; that rank's own error names the file): "
                                "no rank applied it")
        w_norm, u_norm = total[:self.count].sqrt(), total[self.count:n].sqrt()
        for key, part in self.tier.parts.items():
            self._apply_pass(key, part, steps[key], w_norm, u_norm)

    def join_as_failed(self) -> None:
        """This rank refused its step before it began (nvme_tier.py's `check_image`): enter the sum, flagged."""
        partial = self._partial_sums()
        self._mark_failed(partial)
        self.reduce(partial)

    def _partial_sums(self) -> torch.Tensor:
        """Per parameter the partial x² and u² sums, then one failure flag per rank (`step`)."""
        return torch.zeros(2 * self.count + self.comm.world_size, dtype=torch.float32, device=CPU)

    def _mark_failed(self, partial: torch.Tensor) -> None:
        partial.zero_()[2 * self.count + self.comm.rank] = 1

    def _group(self, key) -> dict:
        return self.tier.optimizer.param_groups[key[0]]

    def _moments_pass(self, key, part, partial: torch.Tensor) -> list[dict]:
        group, grad, runs = self._group(key), self.tier.grad_reader(key), self.runs[key]  # from grad_swap.py's files
        scalars = [part.scalars(k) if part.has_state else {} for k in range(len(part.groups))]
        read = dict.fromkeys([MASTER, *MOMENTS] if part.has_state else [MASTER], part.source_slot)

        def visit(k: int, views: dict) -> None:
            s, e = part.groups[k]
            step = advance_step(scalars[k])
            state = {m: views[m] for m in MOMENTS}
            advance_moments(state, grad(s, e), group, views[MASTER])
            update = direction_from_moments(views[MASTER], state, group, step)
            plan = runs.plan(s, e)  # the in-memory step's sums, addend for addend (ops.tensor_segments)
            plan.add_squares(partial[:self.count], views[MASTER])
            plan.add_squares(partial[self.count:2 * self.count], update)
        part.sweep(visit, read, write=MOMENTS)
        return scalars

    def _apply_pass(self, key, part, scalars: list[dict], w_norm, u_norm) -> None:
        group, runs, store = self._group(key), self.runs[key], self.partition.store
        scaled = scaled_ratios(group, w_norm, u_norm)
        source, written = part.source_slot, 1 - part.source_slot  # the moments pass 1 wrote

        def visit(k: int, views: dict) -> None:
            s, e = part.groups[k]
            master = views[MASTER]
            update = direction_from_moments(master, views, group, int(scalars[k]["step"]))
            master.sub_(runs.plan(s, e).scale(update, scaled))
            store.write_behind(key, s, master)  # what the all-gather sends from (nvme_tier.py's note)
        part.sweep(visit, {MASTER: source, **dict.fromkeys(MOMENTS, written)}, write=[MASTER])
        part.commit(scalars)


def per_tensor_stepper(tier, zopt):
    """The two-pass step for a per-tensor optimizer, or None for an elementwise one."""
    if isinstance(zopt.optimizer, ops.Lamb):
        return SwappedLamb(tier, zopt)
    if isinstance(zopt.optimizer, ops.MuonWithAuxAdam):
        return SwappedMuon(tier, zopt)
    return None
