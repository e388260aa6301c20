"""What crosses a stage boundary: any nest of tuples, lists and dicts of tensors (float activations,
integer masks, tensors without grad) plus plain constants (int, float, bool, str, None).

torch's PipelineStage sends a flat tuple of tensors. So a stage's output is flattened with torch's
pytree into its tensor leaves and a `Structure` (the tree spec and the constant leaves), and the
receiving stage rebuilds the exact nest its layers expect from the tensors and the structure.

[Note: structure once per shape] The structure does not travel with every micro-batch (it did, as
a JSON header tensor: one more send per micro-batch and a host read of it on the receiver, a
device sync on an accelerator). It crosses the boundary once, when the engine probes a new input
(probe.py), and each chunk keeps the structure it receives and the one it produces. The engine
keys its built stages by the first stage's input structure and shapes (engine.py), so a batch with
another structure or sequence length is probed anew; a chunk whose output structure then differs
from its probe's (a constant leaf that depends on the data, say) is an error, not a misread.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

_CONSTANTS = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class Structure:
    """The nest around a flat tuple of tensors: torch's tree spec and the constant leaves by position."""
    spec: pytree.TreeSpec
    constants: tuple  # ((leaf index, value), ...)

    def to_wire(self) -> tuple:
        return pytree.treespec_dumps(self.spec), self.constants

    @staticmethod
    def from_wire(wire: tuple) -> "Structure":
        return Structure(pytree.treespec_loads(wire[0]), tuple(tuple(c) for c in wire[1]))


def flatten(obj) -> tuple[Structure, tuple[torch.Tensor, ...]]:
    """(structure, tensor leaves) of `obj`."""
    leaves, spec = pytree.tree_flatten(obj)
    tensors, constants = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.contiguous())  # point-to-point sends take dense memory (an expand() is not)
        elif isinstance(leaf, _CONSTANTS):
            constants.append((i, leaf))
        else:
            raise TypeError(f"a pipeline stage passed a {type(leaf).__name__} to the next stage; only tensors "
                            "and int/float/bool/str/None (in tuples, lists, dicts) can cross a stage boundary")
    return Structure(spec, tuple(constants)), tuple(tensors)


def unflatten(structure: Structure, tensors: tuple[torch.Tensor, ...]):
    """The nest `flatten` was given."""
    constants = dict(structure.constants)
    it = iter(tensors)
    leaves = [constants[i] if i in constants else next(it) for i in range(structure.spec.num_leaves)]
    return pytree.tree_unflatten(leaves, structure.spec)


def signature(structure: Structure, tensors: tuple[torch.Tensor, ...]) -> tuple:
    """Structure, shapes and dtypes of a flattened micro-batch: what its stage buffers depend on. Hashable
    and cheap (no serialisation: it is taken of every micro-batch); `fingerprint` digests it once."""
    return structure, tuple((t.shape, t.dtype) for t in tensors)


def fingerprint(key) -> int:
    """A 63-bit digest of a batch's signature, one int64 of the batch's agreement (batch_agreement.py)."""
    structure, shapes = key
    text = repr((structure.to_wire(), tuple((tuple(shape), str(dtype)) for shape, dtype in shapes)))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
