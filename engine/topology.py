"""The parallel topology: one grid of ranks over pipe × data × model axes, and every process group
derived from it (DESIGN decision 11).

The grid is `arange(world).view(pipe, data, model)`: the model (tensor-parallel) axis is innermost, so
a tensor-parallel group is consecutive ranks (one node's GPUs), then data, then pipe outermost — the
order of DeepSpeed's `PipeModelDataParallelTopology` and Megatron-LM. `Topology` is the pure grid
(no process group, usable offline: `dstrain topology --world 8 --pipe 2 --model 2`);
`ProcessGroups(topology)` creates the groups of every axis on every rank (torch requires every rank
to take part in creating every group, in the same order) and keeps this rank's:

- `data_group`: ranks that differ only in the data coordinate (gradient averaging, ZeRO partitions);
- `pipe_group`: ranks that differ only in the pipe coordinate (activations between stages);
- `model_group`: ranks that differ only in the model coordinate (tensor-parallel collectives);
- `model_parallel_group`: pipe × model at one data coordinate: the ranks that together hold one copy
  of the model, over which a gradient norm is summed (each parameter counted once) before the data
  group agrees on it;
- `tie_group(stages)`: the ranks of the given pipe stages at this rank's data/model coordinates (tied
  weights, e.g. an embedding on the first stage and the LM head on the last).

A group that spans the whole world is `None` (torch's default group), as before this module existed.
`set_current()` / `current()` make one `ProcessGroups` the engine's, so layers built later (tensor
parallel, pipeline stages) find their groups without threading them through every constructor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

AXES = ("pipe", "data", "model")


class Coord(NamedTuple):
    pipe: int
    data: int
    model: int


@dataclass(frozen=True)
class Topology:
    """The grid `arange(world).view(pipe, data, model)` (module docstring)."""

    pipe: int = 1
    data: int = 1
    model: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"Topology: {axis}={size!r}; every axis needs a positive whole number of ranks")

    @classmethod
    def for_world(cls, world: int, pipe: int = 1, model: int = 1) -> "Topology":
        """The data axis is what `pipe` × `model` leave of `world`; an uneven split is an error."""
        if world % (pipe * model):
            raise ValueError(f"world size {world} is not divisible by pipe {pipe} × model {model} = {pipe * model}; "
                             "choose degrees whose product divides the number of ranks")
        return cls(pipe=pipe, data=world // (pipe * model), model=model)

    @classmethod
    def from_world(cls) -> "Topology":
        """Pure data parallelism over the initialised world (what every job without pipe/model axes is)."""
        return cls(data=dist.get_world_size() if dist.is_initialized() else 1)

    @property
    def world_size(self) -> int:
        return self.pipe * self.data * self.model

    def coord(self, rank: int) -> Coord:
        """(pipe, data, model) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this {self.world_size}-rank topology")
        pipe, rest = divmod(rank, self.data * self.model)
        data, model = divmod(rest, self.model)
        return Coord(pipe, data, model)

    coords = coord  # the name `dist.Topology` had

    def rank_of(self, pipe: int = 0, data: int = 0, model: int = 0) -> int:
        for axis, value in zip(AXES, (pipe, data, model)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis}={value} is outside this topology's {axis} axis of {getattr(self, axis)}")
        return (pipe * self.data + data) * self.model + model

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate of `rank` but `axis` (its group along that axis)."""
        here = self.coord(rank)._asdict()
        return [self.rank_of(**{**here, axis: i}) for i in range(getattr(self, axis))]

    def data_parallel_ranks(self, rank: int) -> list[int]:
        """The name `dist.Topology` had for `axis_ranks("data", rank)`."""
        return self.axis_ranks("data", rank)

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, in a fixed order (the order every rank creates them in)."""
        seen: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            ranks = self.axis_ranks(axis, rank)
            seen.setdefault(tuple(ranks), ranks)
        return list(seen.values())

    def model_parallel_groups(self) -> list[list[int]]:
        """pipe × model at each data coordinate: the ranks holding one whole copy of the model."""
        return [[self.rank_of(p, d, m) for p in range(self.pipe) for m in range(self.model)] for d in range(self.data)]

    def stage_groups(self, stages: list[int]) -> list[list[int]]:
        """For each (data, model) coordinate, the ranks of the given pipe stages (tied weights)."""
        return [[self.rank_of(s, d, m) for s in stages] for d in range(self.data) for m in range(self.model)]

    def rank_map(self) -> str:
        """A readable table: one line per rank with its coordinates and groups."""
        lines = [f"topology: pipe={self.pipe} × data={self.data} × model={self.model} = {self.world_size} ranks "
                 "(model innermost, pipe outermost)",
                 f"{'rank':>4}  {'pipe':>4} {'data':>4} {'model':>5}  data group / pipe group / model group"]
        for rank in range(self.world_size):
            c = self.coord(rank)
            lines.append(f"{rank:>4}  {c.pipe:>4} {c.data:>4} {c.model:>5}  {self.axis_ranks('data', rank)} / "
                         f"{self.axis_ranks('pipe', rank)} / {self.axis_ranks('model', rank)}")
        return "\n".join(lines)


def _new_groups(all_ranks: list[list[int]], mine: int, world: int):
    """Create every group in `all_ranks` (collective: all ranks, same order); return the one with `mine`.
    A group of the whole world is the default group (None); a group of one rank needs no process group
    either, but is created anyway when others exist so every rank makes the same calls."""
    if len(all_ranks) == 1 and len(all_ranks[0]) == world:
        return None
    found = None
    for ranks in all_ranks:
        group = dist.new_group(ranks) if dist.is_initialized() else None
        if mine in ranks:
            found = group
    return found


def _connected() -> None:
    """After every rank created the same groups: none returns before all are connected (engine/dist.py's
    note). gloo connects a group's members inside `new_group`, and a group of three or more meets the same
    race as the default one: with tests/test_dist_init.py's slow store and 2 pipe × 3 data ranks leaving
    right after, 2 of 3 runs of 3 tries failed in connectFullMesh without this barrier. (A group of two
    cannot: its one pair is up when its connect returns.) No test holds it: the race is rare per try here,
    one run in four caught its removal."""
    from .dist import connected_everywhere  # here: dist.py imports this module
    if dist.is_initialized():
        connected_everywhere()


class ProcessGroups:
    """This rank's process groups along every axis of `topology` (module docstring). Collective."""

    def __init__(self, topology: Topology, rank: int | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if topology.world_size != world:
            raise ValueError(f"topology pipe={topology.pipe} × data={topology.data} × model={topology.model} = "
                             f"{topology.world_size} ranks, but the job has {world}; make the degrees multiply "
                             "to the number of processes started")
        self.topology = topology
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.coord = topology.coord(self.rank)
        self.data_group = _new_groups(topology.axis_groups("data"), self.rank, world)
        self.pipe_group = _new_groups(topology.axis_groups("pipe"), self.rank, world)
        self.model_group = _new_groups(topology.axis_groups("model"), self.rank, world)
        self.model_parallel_group = _new_groups(topology.model_parallel_groups(), self.rank, world)
        self._tie_groups: dict[tuple[int, ...], object] = {}
        _connected()

    # DeepSpeed's grid names (`PipelineParallelGrid`), for code written against them.
    @property
    def stage_id(self) -> int:
        return self.coord.pipe

    @property
    def data_parallel_rank(self) -> int:
        return self.coord.data

    @property
    def model_parallel_rank(self) -> int:
        return self.coord.model

    def ranks(self, axis: str) -> list[int]:
        return self.topology.axis_ranks(axis, self.rank)

    def tie_group(self, stages: list[int]):
        """The group of `stages` at this rank's data/model coordinates. Collective the first time a
        given set of stages is asked for: every rank must ask for it, in the same order."""
        key = tuple(sorted(set(stages)))
        if key not in self._tie_groups:
            world = self.topology.world_size
            self._tie_groups[key] = _new_groups(self.topology.stage_groups(list(key)), self.rank, world)
            _connected()
        return self._tie_groups[key]

    def duplicate(self, axis: str):
        """A second process group with the same members as this rank's `axis` group (collective: every
        rank creates every group of the axis), e.g. stage 3's separate parameter-gather group."""
        groups = self.topology.axis_groups(axis)
        found = None
        for ranks in groups:
            group = dist.new_group(ranks) if dist.is_initialized() and len(ranks) > 1 else None
            if self.rank in ranks:
                found = group
        _connected()
        return found


_CURRENT: list[ProcessGroups] = []


def set_current(groups: ProcessGroups) -> None:
    """Make `groups` the engine's (initialize() does this before building the model's stages)."""
    _CURRENT[:] = [groups]


def current() -> ProcessGroups:
    """The current engine's groups; pure data parallelism over the world when none was set."""
    if not _CURRENT:
        _CURRENT.append(ProcessGroups(Topology.from_world()))
    return _CURRENT[0]


def model_parallel_if_set() -> ProcessGroups | None:
    """The current groups when they were set for this world and split it beyond the data axis (a model
    or pipe axis), else None: what `engine.zero.Init` partitions over by default (its note)."""
    if not _CURRENT or not dist.is_initialized():
        return None
    topo = _CURRENT[0].topology
    if topo.world_size != dist.get_world_size() or topo.data == topo.world_size:
        return None
    return _CURRENT[0]
