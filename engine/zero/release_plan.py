"""ZeRO stage 3's dry run of the release policy: a recorded trace of (pre or post, forward or backward,
unit) events becomes the plan of one pass's all-gathers and, after each post event, the groups kept
gathered (prefetch.py's note: passes and the trace). A group is kept when it is used again within
`max_reuse_distance` parameter elements and at most `max_live_parameters` elements stay gathered
(note: live limit)."""
from __future__ import annotations

from collections import Counter


class ReleasePlanner:
    def __init__(self, unit_groups: list, groups: list, max_live: int, max_reuse: int):
        self.unit_groups, self.groups = unit_groups, groups
        self.max_live, self.max_reuse = max_live, max_reuse

    def simulate(self, trace: list) -> tuple[list, dict]:
        """The plan (event index, gid) of every all-gather, and after each post event the gids kept."""
        gathered: set = set()
        active: Counter = Counter()
        kept_at: dict = {}  # gid -> the post event whose keep set holds it (while it is kept)
        plan, keep = [], {}
        for i, (kind, _, unit) in enumerate(trace):
            if kind == "pre":
                new = [g for g in dict.fromkeys(self.unit_groups[unit]) if g.gid not in gathered]
                self._evict_for(trace, i, sum(g.numel for g in new), gathered, active, kept_at, keep)
                for g in self.unit_groups[unit]:
                    active[g.gid] += 1
                for g in new:
                    plan.append((i, g.gid))
                    gathered.add(g.gid)
                continue
            keep[i] = set()
            for g in self.unit_groups[unit]:
                active[g.gid] = max(0, active[g.gid] - 1)
                live = sum(self.groups[x].numel for x in gathered)
                if active[g.gid] == 0 and g.gid in gathered:
                    if live <= self.max_live and self._reused_within(trace, i, g.gid):
                        keep[i].add(g.gid)
                        kept_at[g.gid] = i
                    else:
                        gathered.discard(g.gid)
        return plan, keep

    def _evict_for(self, trace: list, i: int, need: int, gathered: set, active: Counter, kept_at: dict,
                   keep: dict) -> None:
        """[Note: live limit] Before event i gathers `need` elements, un-keep kept groups (those used
        again farthest ahead first) until `max_live` holds or none is left: the post event that kept one
        releases it instead. Groups in use are never evicted, so a unit larger than the limit is still
        gathered."""
        def live() -> int:
            return sum(self.groups[x].numel for x in gathered)
        idle = [gid for gid in gathered if not active[gid]]
        idle.sort(key=lambda gid: self._next_use(trace, i, gid), reverse=True)
        for gid in idle:
            if live() + need <= self.max_live:
                return
            keep[kept_at.pop(gid)].discard(gid)
            gathered.discard(gid)

    def _next_use(self, trace: list, i: int, gid: int) -> int:
        for j in range(i, len(trace)):
            if trace[j][0] == "pre" and any(g.gid == gid for g in self.unit_groups[trace[j][2]]):
                return j
        return len(trace)

    def _reused_within(self, trace: list, i: int, gid: int) -> bool:
        """Is group `gid` used again within `max_reuse_distance` parameter elements after event i?"""
        distance = 0
        for kind, _, unit in trace[i + 1:]:
            if kind != "pre":
                continue
            groups = self.unit_groups[unit]
            if any(g.gid == gid for g in groups):
                return distance < self.max_reuse
            distance += sum(g.numel for g in groups)
            if distance >= self.max_reuse:
                return False
        return False
