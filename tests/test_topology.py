"""The pipe × data × model grid (engine/topology.py): coordinates in DeepSpeed's order, the rank map
the CLI prints, and process groups whose members are the ranks the grid says (checked by summing
each rank's id over every group on 4 real ranks)."""
from __future__ import annotations

import pytest

from engine.cli import main
from engine.topology import Topology
from tests.harness import run_distributed


def test_model_axis_is_innermost_then_data_then_pipe():
    topo = Topology(pipe=2, data=2, model=2)
    # DeepSpeed's PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2): rank 5 is pipe 1, data 0, model 1.
    assert topo.coord(5) == (1, 0, 1)
    assert [tuple(topo.coord(r)) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for rank in range(topo.world_size):
        assert topo.rank_of(**topo.coord(rank)._asdict()) == rank
    assert topo.axis_ranks("model", 5) == [4, 5]
    assert topo.axis_ranks("data", 5) == [5, 7]
    assert topo.axis_ranks("pipe", 5) == [1, 5]
    assert topo.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert topo.stage_groups([0, 1]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_world_must_divide_into_the_degrees():
    assert Topology.for_world(8, pipe=2, model=2) == Topology(pipe=2, data=2, model=2)
    with pytest.raises(ValueError, match="world size 6 is not divisible by pipe 4"):
        Topology.for_world(6, pipe=4)
    with pytest.raises(ValueError, match="rank 9 is outside"):
        Topology(pipe=2, data=2).coord(9)


def test_cli_prints_the_rank_map(capsys):
    assert main(["topology", "--world", "8", "--pipe", "2", "--model", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipe=2 × data=2 × model=2 = 8 ranks" in out
    assert "   5     1    0     1  [5, 7] / [1, 5] / [4, 5]" in out
    assert main(["topology", "--world", "6", "--pipe", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err


def _sum_ids_over_groups(pipe: int, model: int):
    import torch
    import torch.distributed as dist
    from engine import topology as topo_mod
    topo = Topology.for_world(dist.get_world_size(), pipe=pipe, model=model)
    groups = topo_mod.ProcessGroups(topo)
    topo_mod.set_current(groups)
    out = {}
    for name in ("data_group", "pipe_group", "model_group", "model_parallel_group"):
        t = torch.tensor([float(dist.get_rank())], device="cpu")
        dist.all_reduce(t, group=getattr(groups, name))
        out[name] = float(t)
    t = torch.tensor([float(dist.get_rank())], device="cpu")
    dist.all_reduce(t, group=groups.tie_group([0, pipe - 1]))
    out["tie"] = float(t)
    out["current_is_set"] = topo_mod.current() is groups
    return out


def test_process_groups_hold_the_grid_ranks():
    results = run_distributed(_sum_ids_over_groups, world_size=4, args=(2, 1), timeout=90)
    topo = Topology(pipe=2, data=2)
    for rank, got in enumerate(results):
        assert got["data_group"] == sum(topo.axis_ranks("data", rank))
        assert got["pipe_group"] == sum(topo.axis_ranks("pipe", rank))
        assert got["model_group"] == rank  # a model axis of one: only itself
        assert got["model_parallel_group"] == sum(topo.axis_ranks("pipe", rank))  # pipe × model(1)
        assert got["tie"] == sum(topo.axis_ranks("pipe", rank))
        assert got["current_is_set"]
