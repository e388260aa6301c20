"""`copy.deepcopy` of a module whose parameters ZeRO stage 3 partitions.

[Note: deepcopy] torch's `Parameter.__deepcopy__` clones `p.data` and drops the attributes, so a copy of a
partitioned parameter was a plain, empty tensor: `nn.TransformerEncoder(layer, n)` built inside
`zero.Init` (its `_get_clones` deep-copies the partitioned `layer`) got layers with no weights, and an
EMA or RLHF reference model `copy.deepcopy(model)` trained or ran with nothing in it, silently. Each
partitioned parameter therefore carries its own `__deepcopy__` (an instance attribute, which `copy`
looks up before the class's):
- a parameter `zero.Init` partitioned and no engine owns yet: the copy is partitioned the same way, with
  a copy of this rank's chunk. Every rank copies its own chunk, so this is exact and no collective: a
  copy made on one rank only is fine, and the clones of `nn.TransformerEncoder` equal the plain ones.
- a parameter an engine owns: its chunk is a slot of the engine's fp32 partition and the module carries
  the engine's gather hooks, which a copy would share with the original (the copy's forward would
  gather the original's weights, and a copy run on one rank would wait in a collective the others
  never join). Refused with the ways to build such a copy instead.
"""
from __future__ import annotations

import copy
import weakref

import torch

from offload.chunk_file import SwappedChunk


def copyable_when_partitioned(p: torch.nn.Parameter) -> None:
    """Give partitioned `p` the `__deepcopy__` of the module note."""
    p.__deepcopy__ = _CopyHook(p)


class _CopyHook:
    """`p.__deepcopy__`. It refers to `p` weakly, and pickles as a hook bound to nothing: a strong
    reference from `p`'s own attributes back to `p` made pickle restore the parameter without them."""

    def __init__(self, p: torch.nn.Parameter | None):
        self.ref = weakref.ref(p) if p is not None else None

    def __call__(self, memo: dict) -> torch.nn.Parameter:
        p = self.ref() if self.ref is not None else None
        if p is None:
            raise RuntimeError("copy.deepcopy of a ZeRO-3 partitioned parameter restored from a pickle: its chunk "
                               "is one rank's; gather it with engine.zero.GatheredParameters and copy the full tensor")
        return _deepcopy(p, memo)

    def __reduce__(self):
        return _CopyHook, (None,)


def _deepcopy(p: torch.nn.Parameter, memo: dict) -> torch.nn.Parameter:
    if id(p) in memo:
        return memo[id(p)]
    if getattr(p, "_z3_owner", None) is not None:
        raise RuntimeError(
            f"copy.deepcopy of a module whose parameters ZeRO stage 3 partitions (a parameter of shape "
            f"{tuple(p.ds_shape)}): the copy would be empty and share the engine's hooks. Deep-copy the model before "
            "engine.initialize, or build a new model and load the full weights into it on every rank: "
            "with engine.zero.GatheredParameters(list(model.parameters())): copy.load_state_dict(model.state_dict())")
    out = torch.nn.Parameter(p.data.clone(), p.requires_grad)
    memo[id(p)] = out
    for name, value in p.__dict__.items():
        if name == "__deepcopy__":
            continue
        if name == "_z3_chunk":
            value = value.file.put(value.load()) if isinstance(value, SwappedChunk) else value.clone()
        else:
            value = copy.deepcopy(value, memo)
        setattr(out, name, value)
    out._z3_version = out._version  # the copy's own counter (init_edits.py: edits after partition)
    copyable_when_partitioned(out)
    return out
