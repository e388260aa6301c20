"""`tensor_parallel.autotp_size` at `initialize`: the degree, the topology it implies, and the model
sharded on it.

[Note: order at initialize] The degree T is read before the config is resolved, because batch-size
arithmetic needs the data-parallel size, world / T. Every rank then takes its data group's first
rank's weights, and then its model group's first rank's for every tensor that is not a shard already
(the ranks of one tensor-parallel group must shard the same matrices; for a dense model this is rank
0's weights everywhere, and it works the same on one pipeline stage), AutoTP shards them, and the
optimizer is built on the sharded parameters. A model built from this package's layers (after the
topology existed) is sharded already: AutoTP leaves it alone, and its shards are not broadcast.
Seeds: the default stream gets `seed + data rank × T` (the same on the T ranks of one model:
replicated dropout agrees), the tracked model-parallel stream `that + 2718 + tensor rank`
(engine.checkpointing's `model_parallel_cuda_manual_seed`), distinct for every (data, tensor) pair.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import schemas

from ..comm import Communicator
from ..topology import ProcessGroups, Topology, set_current
from .autotp import shard_model
from .dropout_region import mark_layer_regions
from .group import ModelParallelUnit, tensor_parallel_comm
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, is_partitioned
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


def refused_with_tensor_parallel(model: nn.Module, prebuilt: set[int]) -> list[str]:
    """What does not compose with AutoTP: each one a config key and what to do. (ZeRO-3 does: it
    partitions each rank's shards and replicated parameters over the data axis, norm.py's note.)"""
    if prebuilt or not any(hasattr(p, "_z3_chunk") for p in model.parameters()):
        return []
    return [f"{KEY}: the model was built inside engine.zero.Init, which partitioned its projections before AutoTP "
            "could shard them; build it outside zero.Init (stage 3 partitions it at initialize), or build it from "
            "engine.tensor_parallel's layers inside zero.Init after engine.topology.set_current(ProcessGroups("
            "Topology.for_world(world, model=T)))"]


def apply_tensor_parallel(model: nn.Module, cfg: schemas.Config, groups: ProcessGroups,
                          pipelined: bool = False) -> list[str]:
    """Shard `model` over this rank's model group, seed the dropout streams; the names it replaced.
    A model built from this package's layers is sharded already and kept as it is. `pipelined`: this
    rank holds one stage, which may have no projection while another stage does (checked over the world)."""
    import engine.checkpointing as ac
    comm = tensor_parallel_comm(groups.model_group)
    prebuilt = _prebuilt_degrees(model)
    problems = refused_with_tensor_parallel(model, prebuilt)
    if problems:
        raise schemas.ConfigError(problems)
    if prebuilt - {comm.world_size}:
        raise schemas.ConfigError([f"{KEY}: {comm.world_size}, but the model's engine.tensor_parallel layers split "
                                   f"over {sorted(prebuilt)} rank(s): build them after the topology exists "
                                   "(inside a PipelineModule with topology=Topology(..., model=T), or after "
                                   "engine.topology.set_current), with T equal to the key"])
    replaced = [] if prebuilt else shard_model(model, comm, require_projections=not pipelined)
    if prebuilt:  # AutoTP marked its own pairs; a model of this package's layers gets the same regions
        mark_layer_regions(model)
    if pipelined:
        _require_some_stage_sharded(model, comm.device)
    ac.configure(mpu_=ModelParallelUnit(comm))
    ac.model_parallel_cuda_manual_seed(cfg.seed + groups.coord.data * groups.topology.model)
    return replaced



def _prebuilt_degrees(model: nn.Module) -> set[int]:
    """The group sizes of the tensor-parallel layers a model was built from (empty: a dense model)."""
    return {m.comm.world_size for m in model.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))}


def _require_some_stage_sharded(model: nn.Module, device) -> None:
    """Collective over the world: at least one stage of a pipeline holds tensor-parallel parameters."""
    count = torch.tensor([float(sum(is_partitioned(p) for p in model.parameters()))], device=device)
    Communicator(None).all_reduce(count)
    if count.item() == 0:
        raise schemas.ConfigError([f"{KEY}: no stage of the PipelineModule holds a projection AutoTP knows "
                                   "(column: q_proj, c_attn, qkv, fc, ...; row: o_proj, c_proj, proj, out, ...); "
                                   "build its layers from engine.tensor_parallel instead"])


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
