"""The dense model's state dict from a tensor-parallel or pipelined one: what `engine.save_16bit_model`
writes.

[Note: one file for the model] Each rank of a model group holds its shards; the state dict it
gathered over its data axis (zero/stage3_save.py) therefore names every parameter but holds this
rank's slice of the sharded ones. `dense_state_dict` all-gathers each shard over the model group and
joins them as the checkpoint reader does (checkpoint/tensor_shards.py's `join_shards`: fused sections
one by one, an HF Conv1D weight transposed back), so the file is the dense model's state dict, the one
`load_state_dict` of the unmodified model takes, and one rank (model coordinate 0) writes it. One
parameter is gathered at a time: transient memory of the largest parameter times the degree.
With a pipeline each stage holds its own layers (named by their global index), so the stages' state
dicts are then exchanged over the pipe group of the data-rank-0, model-rank-0 ranks and merged (a tied
weight is the same tensor on each holder): those ranks hold the whole model in host memory for the
write; pipe coordinate 0 writes.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from .layers import is_partitioned


def _layout(p: torch.Tensor, degree: int) -> dict:
    return {"dim": p.tensor_parallel_dim, "parts": p.tensor_parallel_parts, "degree": degree,
            "transposed": bool(getattr(p, "tensor_parallel_transposed", False))}


def dense_state_dict(state: dict, module: torch.nn.Module, comm: Communicator) -> dict:
    """Collective over the model group `comm`: `state` (name → this rank's host tensor, as
    `module.state_dict()` names them) with every shard replaced by the full tensor (module note)."""
    from ..checkpoint.tensor_shards import join_shards
    if comm.world_size == 1:
        return state
    params = dict(module.named_parameters(remove_duplicate=False))
    joined: dict[int, torch.Tensor] = {}  # a tied parameter is one tensor under both names
    out = {}
    for name, local in state.items():
        p = params.get(name)
        if p is None or not is_partitioned(p):
            out[name] = local
            continue
        if id(local) not in joined:
            send = local.to(device=comm.device).contiguous()
            shards = torch.empty((comm.world_size, *send.shape), dtype=send.dtype, device=comm.device)
            comm.all_gather(shards, send)
            joined[id(local)] = join_shards(list(shards.unbind(0)), _layout(p, comm.world_size)).to("cpu")
        out[name] = joined[id(local)]
    return out


def whole_model_state(state: dict, module: torch.nn.Module, groups, data_rank: int) -> tuple[dict, bool]:
    """Collective over the data-rank-0 ranks' model and pipe groups: (the dense model's state dict, whether
    this rank writes it) from the state dict this rank gathered over its data axis (module note)."""
    if data_rank != 0:
        return state, False
    coord = groups.coord
    if groups.topology.model > 1:
        state = dense_state_dict(state, module, Communicator(groups.model_group))
    if groups.topology.pipe > 1 and coord.model == 0:
        merged: dict = {}
        for part in Communicator(groups.pipe_group, device="cpu").all_gather_object(state):
            for name, t in part.items():
                merged.setdefault(name, t)
        state = merged
    return state, coord.model == 0 and coord.pipe == 0
