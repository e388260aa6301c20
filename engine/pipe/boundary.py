"""What crosses a stage boundary: any nest of tuples, lists and dicts of tensors (float activations,
integer masks, tensors without grad) plus plain constants (int, float, bool, str, None).

torch's PipelineStage sends a flat tuple of tensors. So a stage's output is flattened with torch's
pytree, and the structure travels with the data as the tuple's first element: a uint8 tensor
holding the JSON of the tree spec and of the constant leaves. The receiving stage rebuilds the
exact nest its layers expect. Shapes may change between batches (sequence lengths): the engine
keys its stages by the input shapes (engine.py), so each shape gets buffers of its size.
"""
from __future__ import annotations

import json

import torch
from torch.utils import _pytree as pytree

_CONSTANTS = (int, float, bool, str, type(None))


def flatten(obj, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(structure tensor, *tensor leaves) for `obj`."""
    leaves, spec = pytree.tree_flatten(obj)
    tensors, constants = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.contiguous())  # point-to-point sends take dense memory (an expand() is not)
        elif isinstance(leaf, _CONSTANTS):
            constants.append([i, leaf])
        else:
            raise TypeError(f"a pipeline stage passed a {type(leaf).__name__} to the next stage; only tensors "
                            "and int/float/bool/str/None (in tuples, lists, dicts) can cross a stage boundary")
    text = json.dumps({"spec": pytree.treespec_dumps(spec), "constants": constants, "n": len(leaves)})
    header = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)
    return (header, *tensors)


def unflatten(flat: tuple[torch.Tensor, ...]):
    """The nest `flatten` was given."""
    meta = json.loads(bytes(flat[0].cpu().tolist()).decode())
    leaves: list = [None] * meta["n"]
    for i, value in meta["constants"]:
        leaves[i] = value
    tensors = iter(flat[1:])
    constant_slots = {i for i, _ in meta["constants"]}
    for i in range(meta["n"]):
        if i not in constant_slots:
            leaves[i] = next(tensors)
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(meta["spec"]))


def signature(flat: tuple[torch.Tensor, ...]) -> tuple:
    """Shapes and dtypes of a flattened micro-batch: the key under which stage buffers are kept."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in flat)
