"""The parameters each reentrant checkpoint region uses, recorded in its forward for ZeRO's first
backward (engine/zero/arrivals.py, note "when to discover").

[Note: a region's parameters] A reentrant region's backward recomputes its forward and runs a backward
of its own, in which every parameter the region used gets its gradient: once per region, summed over
its uses inside it. So a parameter's gradient arrives in pieces exactly when the parameter is used in
more than one place, counting each region once and the rest of the graph once. The rest of the graph
shows its uses (AccumulateGrad nodes); a region's own graph exists only during backward, so the
region's forward records them: every trainable `nn.Parameter` handed to a torch function while it
runs (a TorchFunctionMode), kept on the region's backward node. The record says "unknown" (its
gradients may come in pieces) when the region reads a tensor that needs a gradient and is neither a
parameter nor one of its inputs (a captured activation: the region's backward then runs into the
graph that made it, whose parameters the record cannot see) or when another reentrant region of
dstrain's runs inside it. Recording costs a Python call per op, so it runs only while an engine is
still discovering: until its first reducing backward.

Not seen: a region of torch's own reentrant checkpoint (torch.utils.checkpoint, use_reentrant=True)
nested inside one of dstrain's. Its pieces of a gradient then arrive unannounced, and one that comes
after its bucket was reduced is the error arrivals.py names (never a wrong gradient).
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

_DISCOVERING: weakref.WeakSet = weakref.WeakSet()  # the arrival logs whose first reducing backward is ahead
_ACTIVE: list["_Recorder"] = []  # the recordings running now (a region inside a region)
_ATTRIBUTE = "dstrain_region_params"  # on the region's backward node: a frozenset of parameters, or None


def want(log) -> None:
    """`log` (an ArrivalLog) is discovering: regions record from now on."""
    _DISCOVERING.add(log)


def done(log) -> None:
    _DISCOVERING.discard(log)


class _Recorder(TorchFunctionMode):
    def __init__(self, inputs):
        super().__init__()
        self.inputs = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
        self.params: set[torch.nn.Parameter] = set()
        self.known = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in self.inputs:
                if isinstance(leaf, torch.nn.Parameter):
                    self.params.add(leaf)
                else:
                    self.known = False  # a captured activation (module note)
        return func(*args, **kwargs)


class recording:
    """Around a reentrant region's forward (`inputs`: its arguments): records what it uses, when wanted."""

    def __init__(self, inputs):
        self.recorder = _Recorder(inputs) if _DISCOVERING and torch.is_grad_enabled() else None

    def __enter__(self):
        for outer in _ACTIVE:
            outer.known = False  # a region inside a region (module note)
        if self.recorder is not None:
            _ACTIVE.append(self.recorder)
            self.recorder.__enter__()
        return self

    def __exit__(self, *exc):
        if self.recorder is not None:
            self.recorder.__exit__(*exc)
            _ACTIVE.remove(self.recorder)
        return False

    def attach(self, out) -> None:
        """Keep the record on the backward node of the region's outputs (one node for all of them)."""
        if self.recorder is None:
            return
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                setattr(leaf.grad_fn, _ATTRIBUTE, frozenset(self.recorder.params) if self.recorder.known else None)
                return


def recorded(node):
    """The parameters the region behind backward node `node` used, or None where not known."""
    return getattr(node, _ATTRIBUTE, None)
