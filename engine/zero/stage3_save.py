"""`engine.save_16bit_model(save_dir)`: the model's full 16-bit (or fp32) state dict, written by rank 0.

At stage 3 the module's parameters are empty placeholders between uses, so `module.state_dict()` would
save `torch.Size([0])` tensors (DeepSpeed's most reported ZeRO-3 surprise). Here every rank takes part
in gathering one unit at a time; rank 0 copies each full parameter to host memory as it comes (so the
whole model never sits on rank 0's GPU), writes the file and returns True; tied parameters stay one tensor under both names. As in DeepSpeed this needs
`zero_optimization.stage3_gather_16bit_weights_on_model_save: true` at stage 3; without it nothing is
written, rank 0 says why, and the call returns False.
"""
from __future__ import annotations

import os

import torch

from ..comm import Communicator


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def consolidated_state_dict(module: torch.nn.Module, zopt, rank: int, exclude_frozen: bool = False) -> dict:
    """Collective at stage 3. Rank 0 gets {name: full tensor}; other ranks get {}."""
    full: dict[int, torch.Tensor] = {}
    coordinator = getattr(zopt, "coordinator", None)
    if coordinator is not None:
        for group in coordinator.groups:
            gathered = coordinator.gather_now([group])
            if rank == 0:
                for p in group.params:
                    full[id(p)] = _to_host(p.data)
            for g in gathered:
                g.release()
    if rank != 0:
        return {}
    state = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if exclude_frozen and isinstance(t, torch.nn.Parameter) and not t.requires_grad:
            continue
        if id(t) not in full:
            full[id(t)] = _to_host(t)
        state[name] = full[id(t)]
    return state


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    zopt, rank = engine.zero_optimizer, engine.comm.rank
    if getattr(zopt, "stage", 0) == 3 and not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        if rank == 0:
            print("[dstrain] save_16bit_model: nothing saved: at zero_optimization.stage 3 the weights are "
                  "partitioned; set zero_optimization.stage3_gather_16bit_weights_on_model_save: true to gather "
                  "them on save (or use save_checkpoint)", flush=True)
        return False
    state = consolidated_state_dict(engine.module, zopt, rank, exclude_frozen_parameters)
    writes, done = rank == 0, engine.comm
    groups = getattr(engine, "groups", None)  # shards joined, stages merged (tensor_parallel/dense_state.py)
    if groups is not None and groups.topology.world_size > groups.topology.data:
        from ..tensor_parallel.dense_state import whole_model_state
        state, writes = whole_model_state(state, engine.module, groups, rank)
        done = Communicator(None)
    if writes:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # never a half-written file under the final name
    done.barrier()  # the file is there when any rank returns
    return True
