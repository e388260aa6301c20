"""What optimizers whose step needs whole tensors get from ZeRO stages 1-3 (docs/optimizers.md).

The partitions hold dim-0 fragments of many parameters in one flat per param group (partition.py).
Two kinds of per-tensor optimizer are wired to them here, in `attach_per_tensor`:
- a per-tensor *reduction* (ops.Lamb's trust ratio): `segmented_reduction` lists each flat's fragments as
  runs of their parameters, so the optimizer sums per-parameter partial norms and reduces them once per step;
- a per-tensor *transform* (ops.MuonWithAuxAdam's Newton-Schulz): `OwnerOrthogonalizer` sends each
  matrix's fragments to one owner rank, which orthogonalises it whole, and sends the slices back.
Any other optimizer class that needs whole tensors is refused at stage >= 1 (`per_tensor_problem`).

[Note: owners] Owners are assigned greedily, largest NS5 cost m·n·min(m, n) first, each to the rank
with the least cost so far (LPT scheduling: within 4/3 of the best balance). Every rank computes the
same assignment from the same shapes, so no agreement round is needed.
[Note: two all-to-alls] Fragments travel in one all_to_all: the block for owner o is this rank's slots
of o's matrices, back to back, which is exactly this rank's segment of o's RankMajorLayout; blocks are
padded to the largest owner's segment. The owner's receive buffer is then its layout's rank-major
buffer, unpacked into whole matrices. The results go back the same way in a second all_to_all.
"""
from __future__ import annotations

import torch

import ops
from ops.muon import muon_cost, orthogonalized
from ops.tensor_segments import FlatRuns, SegmentedReduction
from schemas.optimizer_torch import TORCH_NEEDS_CLOSURE, TORCH_PER_TENSOR

from .partition import PartitionedParams, RankMajorLayout


def per_tensor_problem(optimizer, stage: int, from_config: bool) -> str | None:
    """Why `optimizer` cannot step chunks at `stage`, naming what to change; None when it can."""
    name = type(optimizer).__name__
    if type(optimizer) is getattr(torch.optim, name, None) and name in TORCH_PER_TENSOR:
        where = f"optimizer.type: {name}" if from_config else f"initialize(optimizer=torch.optim.{name}(...))"
        return (f"{where} cannot run at zero_optimization.stage {stage}: {TORCH_PER_TENSOR[name]}, and ZeRO "
                "hands the optimizer dim-0 chunks of each tensor; use zero_optimization.stage 0")
    return None


def closure_problem(optimizer, from_config: bool) -> str | None:
    name = type(optimizer).__name__
    if from_config and name in TORCH_NEEDS_CLOSURE and type(optimizer) is getattr(torch.optim, name, None):
        return f"optimizer.type: {name} is not supported through the config: {TORCH_NEEDS_CLOSURE[name]}"
    return None


def all_reduce_sum(comm):
    """vector -> its sum over ranks, reduced on the communicator's device and returned where it was."""
    def reduce(vector: torch.Tensor) -> torch.Tensor:
        staged = vector.to(comm.device)  # the collective runs on the communicator's device (comm.py)
        comm.all_reduce(staged)
        return staged.to(vector.device)
    return reduce


def flat_runs(partition: PartitionedParams, key, index: dict, cache: bool,
              device: torch.device | None = None) -> FlatRuns:
    """Flat `key`'s fragments as runs over the global parameter `index` (padding counts for its own
    parameter: zero weight and update, it adds nothing); plans on `device`, by default the flat's."""
    runs = [(partition.fragments[p].offset, partition.fragments[p].padded, index[p]) for p in partition.members[key]]
    return FlatRuns(runs, partition.flat[key].device if device is None else device, cache=cache)


def segmented_reduction(partition: PartitionedParams, comm) -> SegmentedReduction:
    """Each flat's fragments -> parameter index (the same global index on every rank)."""
    index = {p: i for i, p in enumerate(partition.params())}
    segments = {partition.flat[key]: flat_runs(partition, key, index, cache=True) for key in partition.members}
    return SegmentedReduction(segments, len(index), all_reduce_sum(comm))


def assign_owners(costs: list[int], world: int) -> list[int]:
    """Owner rank of each item, largest cost first to the least loaded rank (module note)."""
    load, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


class OwnerOrthogonalizer:
    """`orthogonalize_flats` for ops.MuonWithAuxAdam over a ZeRO partition (module notes)."""

    def __init__(self, partition: PartitionedParams, comm, muon_groups: set[int], ns_dtype: torch.dtype,
                 matrices: list | None = None, owners: list[int] | None = None):
        """`matrices`: only these, and `owners` theirs (the NVMe step's rounds, nvme_muon.py); default every
        matrix of the groups, owners assigned here."""
        self.partition, self.comm, self.ns_dtype = partition, comm, ns_dtype
        world = comm.world_size
        self.matrices = matrices if matrices is not None else [
            p for key, members in partition.members.items() if key[0] in muon_groups for p in members]
        specs = [partition.fragments[p].spec for p in self.matrices]
        self.owners = owners if owners is not None else assign_owners([muon_cost(s.rows, s.row_numel) for s in specs],
                                                                      world)
        owned = [[p for p, o in zip(self.matrices, self.owners) if o == r] for r in range(world)]
        self.layouts = [RankMajorLayout(ps, [partition.fragments[p].spec for p in ps], world) for ps in owned]
        self.block = max(layout.segment for layout in self.layouts)

    def owned_cost(self) -> list[int]:
        """NS5 cost each rank carries (for the benchmark and the balance test)."""
        cost = [0] * self.comm.world_size
        for p, o in zip(self.matrices, self.owners):
            spec = self.partition.fragments[p].spec
            cost[o] += muon_cost(spec.rows, spec.row_numel)
        return cost

    def __call__(self, flats: list[torch.Tensor], updates: list[torch.Tensor],
                 starts: list[int] | None = None) -> list[torch.Tensor]:
        """updates[i] holds flats[i]'s elements from starts[i] (default 0) on; each matrix's slots are
        replaced by its slices of the orthogonalised matrix, in place."""
        starts = [0] * len(flats) if starts is None else starts
        update_of = {id(f): (u, start) for f, u, start in zip(flats, updates, starts)}
        world, rank, device = self.comm.world_size, self.comm.rank, self.comm.device
        send = torch.zeros(world * self.block, dtype=torch.float32, device=device)
        for owner, layout in enumerate(self.layouts):
            for p, off in zip(layout.params, layout.offsets):
                start = owner * self.block + off
                send[start:start + self._padded(p)].copy_(self._slot(p, update_of))
        received = torch.empty_like(send)
        self.comm.all_to_all(received, send)
        mine = self.layouts[rank]
        results = torch.zeros(world * mine.segment, dtype=torch.float32, device=device)
        if mine.params:
            gathered = received.view(world, self.block)[:, :mine.segment].reshape(-1)
            specs = [self.partition.fragments[p].spec for p in mine.params]
            fulls = [torch.empty(s.rows, s.row_numel, dtype=torch.float32, device=device) for s in specs]
            mine.unpack(gathered, fulls)
            for i, full in enumerate(fulls):
                mine.pack_one(i, orthogonalized(full, self.ns_dtype), results)
        send.view(world, self.block)[:, :mine.segment].copy_(results.view(world, mine.segment))
        self.comm.all_to_all(received, send)
        for owner, layout in enumerate(self.layouts):
            for p, off in zip(layout.params, layout.offsets):
                start = owner * self.block + off
                self._slot(p, update_of).copy_(received[start:start + self._padded(p)])
        return updates

    def _padded(self, p) -> int:
        return self.partition.fragments[p].padded

    def _slot(self, p, update_of: dict) -> torch.Tensor:
        frag = self.partition.fragments[p]
        update, start = update_of[id(self.partition.flat[frag.key])]
        return update[frag.offset - start:frag.offset - start + frag.padded]


def attach_per_tensor(zopt) -> None:
    """Wire a per-tensor optimizer to `zopt`'s partition (module docstring)."""
    optimizer = zopt.optimizer
    if isinstance(optimizer, ops.Lamb):
        optimizer.segmented = segmented_reduction(zopt.partition, zopt.comm)
    if isinstance(optimizer, ops.MuonWithAuxAdam):
        muon_groups = {i for i, g in enumerate(optimizer.param_groups) if g["use_muon"]}
        optimizer.orthogonalize_flats = OwnerOrthogonalizer(zopt.partition, zopt.comm, muon_groups,
                                                            optimizer.ns_dtype)
