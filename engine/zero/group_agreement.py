"""The ranks agree on what they gather at stage 3 (prefetch.py's notes: same collectives on every rank, no
host reads per unit): the plan a recording derived, and the group of each on-demand gather. A part of
`ParamCoordinator` (its `comm`, `groups`, `checks`, `failures`, `in_pass`, `recording`)."""
from __future__ import annotations

import torch

from .gather_requests import RankDivergenceError
from .stage3_params import GatherGroup


class GroupAgreement:
    def _same_plan_everywhere(self, plan: list) -> bool:
        """Plan gathers are issued without asking the other ranks: their plans must be one (a recorded
        pass whose units differed between ranks while every gather agreed: a module inside a unit)."""
        if self.comm.world_size == 1:
            return True
        mine = self.comm.zeros(1, dtype=torch.int64).fill_(hash(tuple(gid for _, gid in plan)) >> 2)
        out = self.comm.empty(self.comm.world_size, dtype=torch.int64)
        self.comm.all_gather(out, mine)
        return len(set(out.tolist())) == 1

    @staticmethod
    def _mismatches(checks: list) -> torch.Tensor:
        return torch.stack([(ids != g.gid).any() for g, ids in checks])

    def _raise_on_mismatch(self, checks: list, mismatched) -> None:
        if not mismatched:
            return
        for _, ids in checks:  # the error path: reads are fine
            self.failures.note_ids(ids.tolist())
        if self.failures.known:
            return  # not a divergence: the caller raises the read failure (stage3_read_failures.py)
        for (g, ids), bad in zip(checks, self._mismatches(checks).tolist()):  # the error path: reads are fine
            if bad:
                raise self._divergence(g, ids.tolist())

    def _deferred_checks(self) -> bool:
        """Compare ids on the device and read them at pass end (module note: no host reads per unit)?"""
        return self.in_pass and self.recording is None

    def _check_same_group(self, g: GatherGroup) -> None:
        """On-demand gathers: agree on the group first with a fixed-size all-gather (module note)."""
        if self.comm.world_size == 1:
            return
        mine = self.comm.zeros(1, dtype=torch.int64).fill_(g.gid)
        out = self.comm.empty(self.comm.world_size, dtype=torch.int64)
        if self._deferred_checks():  # on NCCL the wait orders streams; only a read would block the host
            self.comm.all_gather(out, mine)
            self.checks.append((g, out))
            return
        try:
            self.comm.all_gather(out, mine)
        except RuntimeError as e:
            raise RankDivergenceError(f"ZeRO-3: rank {self.comm.rank} timed out before gathering module "
                                      f"'{g.name}': the ranks ran different modules ({e})") from e
        if any(int(t) != g.gid for t in out):
            raise self._divergence(g, [int(t) for t in out])

    def _divergence(self, g: GatherGroup, tags: list[int]) -> RankDivergenceError:
        seen = ", ".join(f"rank {r}: '{self._group_name(t)}'" for r, t in enumerate(tags))
        return RankDivergenceError(
            f"ZeRO-3: the ranks gathered the parameters of different modules at the same point ({seen}; "
            f"this is rank {self.comm.rank}, about to run '{g.name}'). With zero_optimization.stage 3 every "
            "rank must run the same modules in the same order: a layer skipped or added on some ranks "
            "(rank-divergent control flow) would otherwise hang or mix weights")

    def _group_name(self, gid: int) -> str:
        return self.groups[gid].name if 0 <= gid < len(self.groups) else f"<group {gid}>"
