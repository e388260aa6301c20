"""Backward starts from every unit output of a training pass, not only from the loss.

[Note: anchors] A unit that ran forward on every rank but whose output reaches the loss on some
ranks only (an auxiliary head whose loss term a rank's batch skips, an output detached on one
rank) ran its backward only there. Its backward gathers were then on the plan on some ranks and
missing on others, or, when no rank's loss used it while the order was recorded, off the plan on
the ranks that did: an on-demand gather against the others' plan gathers, which aborted gloo or
hung; and the ranks that skipped it reduced its gradient bucket only at the end, while the others
waited on that reduction mid-backward. So every unit output of a training pass that has a
gradient function is kept as a gradient edge, and backward starts from the loss and from each of
them with a zero gradient (an expanded zero: no memory). Every unit that ran forward then runs
backward on every rank, and gives its parameters zero gradients where its output got none; the
gradient flats hold zeros for them anyway, so the result is unchanged. Autograd runs the ready node
created last first, so such a unit's backward comes where it comes on the ranks whose loss uses it.
The cost: one addition of that zero into each unit output's gradient, and the graph of an output
that no loss uses lives until backward. Evaluation passes anchor nothing, nor does a backward outside
its pass (prefetch.py's note there): those gather in request rounds.
[Note: reentrant regions] A reentrant activation checkpoint (torch.utils.checkpoint with
use_reentrant=True, engine.checkpointing.checkpoint) runs its forward without gradients: the unit outputs
inside it have no gradient function and cannot be anchored. Its backward recomputes that forward (the
units gather again) and runs the units' backward, on the ranks whose loss reaches the region's output
only. Measured before this note (2 ranks, an auxiliary head in a region whose loss term one rank's
batch skips): a hang until the harness killed it when no rank used the head while the order was
recorded, gloo aborting the process otherwise. So while a training pass's forward runs, the outputs of
torch's reentrant checkpoint function (`CheckpointFunction.apply`, which both APIs call) are anchored
too: every rank runs every region's backward, recompute included, at the same point, and a region no
loss uses on this rank gives zero gradients, as a unit does. The wrapper is installed for the forward
only (`open` / `close`) and notes to the innermost open pass; the cost is that of a unit's anchor.
"""
from __future__ import annotations

import threading

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

_OPEN: list["BackwardAnchors"] = []  # the training passes whose forward runs now, innermost last
_PATCHED: dict = {}  # "apply" -> CheckpointFunction.apply as it was, while the wrapper is installed
# passes open and close on several threads (two models' forwards): the list and torch's class change together
_LOCK = threading.Lock()


class BackwardAnchors:
    def __init__(self):
        self.edges: list = []  # (gradient edge, shape, dtype, device)
        self.thread = None  # the thread whose forward `open` began

    def note(self, tensors: list) -> None:
        for t in tensors:
            if t.grad_fn is not None:  # a leaf (an input passed through) has nothing to run
                self.edges.append((get_gradient_edge(t), t.shape, t.dtype, t.device))

    def open(self) -> None:
        """A training pass's forward begins: reentrant regions' outputs are anchored here (module note)."""
        with _LOCK:
            if any(a is self for a in _OPEN):
                return
            if not _OPEN:
                _install_region_wrapper()
            self.thread = threading.get_ident()
            _OPEN.append(self)

    def close(self) -> None:
        """The forward ended (or the pass did)."""
        with _LOCK:
            if any(a is self for a in _OPEN):
                _OPEN[:] = [a for a in _OPEN if a is not self]
                if not _OPEN:
                    _remove_region_wrapper()

    def clear(self) -> None:
        self.edges = []

    def take(self) -> list:
        """(gradient edge, zero gradient) pairs; one zero scalar per dtype and device, expanded (an
        in-place write into an expanded tensor is an error in torch, so they cannot be corrupted)."""
        edges, self.edges = self.edges, []
        zeros: dict = {}
        out = []
        for edge, shape, dtype, device in edges:
            zero = zeros.get((dtype, device))
            if zero is None:
                zero = zeros[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
            out.append((edge, zero.expand(shape)))
        return out


def _anchored_region(*args, **kwargs):
    """`CheckpointFunction.apply` while a training forward runs: its outputs are anchored (module note)."""
    # another thread's last pass may have removed the wrapper since this call entered it (torch's own is
    # then back on the class): not waited for, a region's forward runs here
    out = (_PATCHED.get("apply") or torch_checkpoint.CheckpointFunction.apply)(*args, **kwargs)
    # the innermost pass of this thread: the class attribute is seen by every thread, and another
    # thread's region (another model's) in this pass's anchors would run that graph's backward here
    me = threading.get_ident()
    anchors = next((a for a in reversed(_OPEN) if a.thread == me), None)
    if anchors is not None:
        # unseen by a TorchFunctionMode around the call: engine.checkpointing's record of the region's
        # parameters (region_params.py) counted this read of its output as a captured activation
        with torch._C.DisableTorchFunction():
            anchors.note([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
    return out


def _install_region_wrapper() -> None:
    function = torch_checkpoint.CheckpointFunction
    _PATCHED["apply"] = function.apply  # bound to the class, as called
    _PATCHED["own"] = function.__dict__.get("apply")  # None: inherited from autograd.Function, deleted after
    function.apply = _anchored_region


def _remove_region_wrapper() -> None:
    function = torch_checkpoint.CheckpointFunction
    own = _PATCHED.pop("own")
    if own is not None:
        function.apply = own
    else:
        del function.apply
    del _PATCHED["apply"]


def backward_from(loss: torch.Tensor, anchors: list, retain_graph: bool) -> None:
    """Backward from the loss and from each (gradient edge, zero gradient) anchor (module note); from the
    loss alone where there is none (stages 1-2, evaluation, a backward outside its pass)."""
    if not anchors:
        loss.backward(retain_graph=retain_graph)
        return
    torch.autograd.backward([loss] + [edge for edge, _ in anchors], [None] + [zero for _, zero in anchors],
                            retain_graph=retain_graph)
