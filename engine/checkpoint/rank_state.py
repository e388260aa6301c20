"""State that belongs to one rank, not to a parameter's rows: saved in that rank's own file.

The row layout (state.py) stores per-parameter state once, cut into rows over the ranks, which is
right when every rank holds the same values. The 1-bit optimizers (ops/compressed_optimizer.py) also
keep per-rank error-feedback buffers and phase counters, stage 0's PowerSGD reducer its per-rank error
feedback and shared Q matrices, and 0/1 Adam's local steps make parameters and moments differ between
ranks (ops/zero_one_adam.py). An optimizer with such state offers `rank_state()` /
`load_rank_state(saved, same_world)`; the snapshot puts it and the reducer's `state_dict()` in the rank
file ("optimizer"), and a load hands rank r its own file's entries. At another world size there is no
telling which saved rank a new rank continues: every rank takes rank 0's entries with
`same_world=False` (DeepSpeed's choice); counters and Q survive, error buffers restart at zero with a
warning, and 0/1 Adam's ranks all continue rank 0's local steps. Before this file existed a resume
through save/load_checkpoint lost all of it (1-bit Adam ended 0.3 away from the uninterrupted run;
tests/test_compression_optimizers.py, tests/test_compression_powersgd.py).
"""
from __future__ import annotations

import warnings

import torch

from ops.compressed_optimizer import host_copy


def _optimizer(eng):
    opt = getattr(eng.zero_optimizer, "optimizer", None)
    return opt if hasattr(opt, "rank_state") else None


def _powersgd(eng):
    return getattr(eng.zero_optimizer, "powersgd", None)  # stage 0's reducer (gradient_compression)


def save_rank_state(eng):
    """This rank's entries (copies: an async save's writer reads them after the next step), or None."""
    opt, reducer = _optimizer(eng), _powersgd(eng)
    if opt is None and reducer is None:
        return None
    return {"optimizer": opt.rank_state() if opt is not None else None,
            "powersgd": host_copy(reducer.state_dict()) if reducer is not None else None}


def load_rank_state(eng, src, rank: int, world: int) -> None:
    opt, reducer = _optimizer(eng), _powersgd(eng)
    if opt is None and reducer is None:
        return
    same_world = src.meta["world_size"] == world
    saved = src.rank_extras(rank if same_world else 0).get("optimizer") or {}
    if opt is not None and saved.get("optimizer") is not None:
        opt.load_rank_state(saved["optimizer"], same_world=same_world)
    if reducer is not None and saved.get("powersgd") is not None:
        state = saved["powersgd"]
        if not same_world:  # PowerSGD's error feedback is this rank's residual: restart it (its Q are shared)
            if rank == 0 and state["errors"]:
                warnings.warn(f"gradient_compression: the checkpoint's PowerSGD errors were saved at world size "
                              f"{src.meta['world_size']}, now {world}; they restart at zero", stacklevel=4)
            state = {**state, "errors": {}}
        reducer.load_state_dict(to_device(state, eng.comm.device))


def to_device(obj, device: torch.device):
    """`obj` with every tensor moved to `device` (a file's tensors are on the host)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
