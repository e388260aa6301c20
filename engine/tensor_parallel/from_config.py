"""`tensor_parallel.autotp_size` at `initialize`: the degree, the topology it implies, and the model
sharded on it.

[Note: order at initialize] The degree T is read before the config is resolved, because batch-size
arithmetic needs the data-parallel size, world / T. Every rank then takes rank 0's full weights (a
broadcast over the world, not the data group: the ranks of one tensor-parallel group must shard the
same matrices), AutoTP shards them, and the optimizer is built on the sharded parameters.
Seeds: the default stream gets `seed + data rank × T` (the same on the T ranks of one model:
replicated dropout agrees), the tracked model-parallel stream `that + 2718 + tensor rank`
(engine.checkpointing's `model_parallel_cuda_manual_seed`), distinct for every (data, tensor) pair.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

import schemas

from ..topology import ProcessGroups, Topology, set_current
from .autotp import shard_model
from .group import ModelParallelUnit, tensor_parallel_comm
from .norm import agree_norm_over_tensor_parallel  # noqa: F401 - initialize's route to it (build.py)

KEY = "tensor_parallel.autotp_size"


def requested_degree(source: Any, overrides: dict | None) -> int:
    """T as the config asks (1 when off); a malformed value counts as 1 here and the schema reports it."""
    if overrides and KEY in overrides:
        value = overrides[KEY]
    elif isinstance(source, schemas.Config):
        value = source.tensor_parallel.autotp_size
    else:
        raw, _ = schemas.read_config_source(source)
        section = raw.get("tensor_parallel") if isinstance(raw, dict) else None
        value = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    if isinstance(value, float) and value.is_integer():  # 2.0: the schema takes integral floats as ints
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def tensor_parallel_groups(degree: int) -> ProcessGroups | None:
    """The process groups of world = data × `degree` (model innermost), made the current topology;
    None for degree 1 (pure data parallelism needs no groups of its own). Collective."""
    if degree == 1:
        return None
    world = dist.get_world_size()
    if world % degree:
        raise schemas.ConfigError([f"{KEY}: {degree} does not divide the world size {world}; start a multiple of "
                                   f"{degree} processes or choose a degree that divides {world}"])
    groups = ProcessGroups(Topology.for_world(world, model=degree))
    set_current(groups)
    return groups


def refused_with_tensor_parallel(cfg: schemas.Config) -> list[str]:
    """What does not compose with AutoTP yet: each one a config key and what to do."""
    problems = []
    if cfg.zero_optimization.stage > 1:
        problems.append(f"zero_optimization.stage {cfg.zero_optimization.stage} with {KEY} > 1 is not built yet "
                        "in dstrain; use stage 0 or 1")
    return problems


def apply_tensor_parallel(model: nn.Module, cfg: schemas.Config, groups: ProcessGroups) -> list[str]:
    """Shard `model` over this rank's model group, seed the dropout streams; the names it replaced."""
    problems = refused_with_tensor_parallel(cfg)
    if problems:
        raise schemas.ConfigError(problems)
    import engine.checkpointing as ac
    comm = tensor_parallel_comm(groups.model_group)
    replaced = shard_model(model, comm)
    ac.configure(mpu_=ModelParallelUnit(comm))
    ac.model_parallel_cuda_manual_seed(cfg.seed + groups.coord.data * groups.topology.model)
    return replaced



def check_parameters(model: nn.Module, param_groups: list, optimizer) -> None:
    """Parameters named before sharding are gone from the model: an optimizer over them would train nothing."""
    current = {id(p) for p in model.parameters()}
    named = [p for g in param_groups for p in (g["params"] if isinstance(g, dict) else [g])]
    if optimizer is not None and not callable(optimizer):
        named += [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in current for p in named):
        raise ValueError(f"{KEY} > 1 replaces the model's projections at initialize, so parameters taken before it "
                         "(a list passed as model_parameters=, or an optimizer built on them) are not the model's; "
                         "pass model_parameters=None or model.parameters() and let the config build the optimizer, "
                         "or pass optimizer= as a callable taking the parameters")
