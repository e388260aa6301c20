"""Where each rank of a save sits in the pipe × data × model grid, and how the ranks' tables merge.

[Note: placement] A checkpoint is written by every process of the world: the rank file is named by
the *global* rank (two pipeline stages share a data-parallel rank, so a data-parallel name would
collide), the global rank 0 is the one committer (writer.py's note: atomic commit), and metadata.json
records each file's (pipe, data, model) coordinates. Within a stage, fragment rows are still cut by
the data-parallel rank (the ZeRO partition), so a reader at any layout asks for rows by parameter
name and gets them from whichever files hold them (reader.py's note: resharding).
[Note: stages] Each stage saves only its own layers' parameters, under their global names (a
PipelineModule names them by layer index, independent of the stage count) and with full shapes, so the
union over stages is the whole model. A tied weight (embedding and LM head) lives on two stages and
is equal on both after every step: the table keeps the first stage's fragments only.
"""
from __future__ import annotations

import torch.distributed as dist

from ..topology import Coord
from .tensor_shards import KEY


def global_rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def coordinates(eng) -> Coord:
    """This rank's (pipe, data, model) coordinate: the engine's topology groups where it has them (a
    pipeline, tensor parallelism), else pure data parallelism (the data coordinate is the data rank)."""
    groups = getattr(eng, "groups", None)
    if groups is not None:
        return groups.coord
    return Coord(pipe=0, data=eng.comm.rank, model=0)


def model_degree(eng) -> int:
    """The size of the model (tensor-parallel) axis: how many shards a sharded parameter has."""
    groups = getattr(eng, "groups", None)
    return groups.topology.model if groups is not None else 1


def merge_tables(gathered: list[dict]) -> tuple[dict, dict, list[str]]:
    """(params, aliases, state_dict_keys) of the whole model from each rank's own table (module note:
    stages; tensor_shards.py's note: shards). `gathered[r]` is global rank r's {"coord", "index",
    "described", "aliases", "keys"}: index name -> [start, stop, kinds]; described name -> [full shape,
    dtype, trainable, tensor-parallel layout or None]. A sharded parameter's fragments carry the shard
    index, the saving rank's model coordinate; the pipe and model coordinates are independent, so a
    pipe × model grid merges the same way."""
    params: dict = {}
    owner_stage: dict[str, int] = {}
    aliases: dict = {}
    keys: list[str] = []
    seen_keys: set[str] = set()
    for rank, table in sorted(enumerate(gathered), key=lambda rt: (rt[1]["coord"][0], rt[0])):
        stage = table["coord"][0]
        for name, (start, stop, classes) in table["index"].items():
            if owner_stage.setdefault(name, stage) != stage:
                continue  # a tied copy on a later stage (module note: stages)
            described = table["described"][name]
            layout = described[3] if len(described) > 3 else None
            if name not in params:
                shape, dtype, trainable = described[:3]
                params[name] = {"shape": list(shape), "dtype": dtype, "trainable": trainable, "kinds": classes,
                                "fragments": []}
                if layout is not None:
                    params[name][KEY] = layout
            params[name]["fragments"].append([rank, start, stop] if layout is None else
                                             [rank, start, stop, table["coord"][2]])
        for key, name in table["aliases"].items():
            aliases.setdefault(key, name)
        for key in table["keys"]:
            if key not in seen_keys:
                seen_keys.add(key)
                keys.append(key)
    return params, aliases, keys


def stage_union(eng, held: set[str]) -> set[str] | None:
    """Every name the whole model holds, when this rank holds one pipeline stage's share (collective
    over the pipe group); None where the rank holds the whole model."""
    groups = getattr(eng, "groups", None)
    if groups is None or groups.topology.pipe == 1:
        return None
    from ..comm import Communicator
    return set().union(*Communicator(groups.pipe_group).all_gather_object(sorted(held)))
