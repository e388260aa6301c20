"""The rank map: which global ranks run on which node, shared by `dslaunch` and every agent.

Ranks are assigned host by host in hostfile order (as DeepSpeed does): node 0 holds ranks
0..n0-1, node 1 the next n1 ranks, and so on. The map travels to the agents as one base64 word, so
no shell ever has to quote it.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    slot: str


@dataclass(frozen=True)
class WorldInfo:
    """Ordered (host, slot ids) pairs; the position of a pair is the node rank."""

    nodes: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_slots(cls, slots_by_host: dict[str, tuple[str, ...]]) -> "WorldInfo":
        return cls(tuple((host, tuple(slots)) for host, slots in slots_by_host.items()))

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for _, slots in self.nodes)

    @property
    def hosts(self) -> list[str]:
        return [host for host, _ in self.nodes]

    def node_rank_of(self, host: str) -> int:
        for node_rank, (name, _) in enumerate(self.nodes):
            if name == host:
                return node_rank
        raise KeyError(f"host {host!r} is not in the rank map ({', '.join(self.hosts)})")

    def placements(self, node_rank: int | None = None) -> list[RankPlacement]:
        """Every rank (or only those of `node_rank`) with its node, local rank and slot."""
        result, rank = [], 0
        for index, (host, slots) in enumerate(self.nodes):
            for local_rank, slot in enumerate(slots):
                if node_rank is None or node_rank == index:
                    result.append(RankPlacement(rank, index, local_rank, host, slot))
                rank += 1
        return result

    def encode(self) -> str:
        payload = json.dumps([[host, list(slots)] for host, slots in self.nodes]).encode()
        return base64.urlsafe_b64encode(payload).decode()

    @classmethod
    def decode(cls, text: str) -> "WorldInfo":
        nodes = json.loads(base64.urlsafe_b64decode(text.encode()))
        return cls(tuple((str(host), tuple(str(s) for s in slots)) for host, slots in nodes))
