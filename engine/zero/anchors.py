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
"""
from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge


class BackwardAnchors:
    def __init__(self):
        self.edges: list = []  # (gradient edge, shape, dtype, device)

    def note(self, tensors: list) -> None:
        for t in tensors:
            if t.grad_fn is not None:  # a leaf (an input passed through) has nothing to run
                self.edges.append((get_gradient_edge(t), t.shape, t.dtype, t.device))

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


def backward_from(loss: torch.Tensor, anchors: list, retain_graph: bool) -> None:
    """Backward from the loss and from each (gradient edge, zero gradient) anchor (module note); from the
    loss alone where there is none (stages 1-2, evaluation, a backward outside its pass)."""
    if not anchors:
        loss.backward(retain_graph=retain_graph)
        return
    torch.autograd.backward([loss] + [edge for edge, _ in anchors], [None] + [zero for _, zero in anchors],
                            retain_graph=retain_graph)
