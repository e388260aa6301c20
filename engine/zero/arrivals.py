"""Which parameters got a gradient, and how often, shared by every stage's gradient hooks.

[Note: gradients that arrive twice] A post-accumulate-grad hook normally fires once per parameter and
backward: autograd sums every use of a parameter before its AccumulateGrad node runs. With reentrant
activation checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`) each checkpointed region
runs a backward of its own, so a parameter used in two regions (a shared block, tied weights inside a
region) gets its gradient in two pieces, the second possibly after its bucket was reduced. So the
first reducing backward of a run launches no bucket before backward ends and counts the arrivals; a
bucket with a parameter that arrived twice is *deferred* from then on: it waits for the end of
backward, however its hooks fire. Ranks may defer different buckets (a data-dependent graph): that
changes when a rank issues a bucket's collective, never the order, so the ranks still agree. Buckets
after a deferred one also wait (the fixed launch order), which costs overlap, not exactness. A
parameter that arrives twice later in a bucket already reduced (the graph changed after the first
backward) is an error naming it: its gradient can no longer be reduced exactly.
[Note: when to discover] Only a node that runs a backward of its own can deliver a parameter's gradient
in pieces, and autograd's C++ nodes never do: it takes a Python autograd Function (reentrant
checkpointing's CheckpointFunction, a library's custom Function). dstrain's own Functions whose
backward only computes or communicates (stage 3's post-backward marker, tensor parallelism's region
mappings, activation partitioning's scatter and gather) say so with `delivers_gradients_once = True`
and do not count. dstrain's own reentrant `checkpoint` records the parameters each region uses
(engine/activation_checkpointing/region_params.py): its regions count only when a parameter is used in
two of them, or in one and outside them. The discovery holds every full
gradient until backward ends (the model's whole gradient, on the accelerator, or in a swap file with
grad_swap.py's held gradients) and gives up the first backward's overlap, so `before_reducing_backward`
walks the loss's graph once and skips it when no such node is there. A graph that gains one later and
then delivers a late piece gets the error above, naming the parameter.
"""
from __future__ import annotations

import hashlib
import struct
import warnings

import torch
import torch.distributed as dist

from ..activation_checkpointing import region_params


class ArrivalLog:
    def __init__(self, names: dict[torch.nn.Parameter, str] | None = None):
        self.names = names or {}
        self.discovering = True  # until the first reducing backward ended (module note)
        region_params.want(self)  # reentrant regions record their parameters until then
        self.window: set[torch.nn.Parameter] = set()  # got a gradient in this accumulation window
        self._this_pass: set[torch.nn.Parameter] = set()

    def arrive(self, param: torch.nn.Parameter, reducing: bool) -> bool:
        """Record a gradient of `param`; True when it already got one in this reducing backward."""
        self.window.add(param)
        if not reducing:
            return False
        if param in self._this_pass:
            return True
        self._this_pass.add(param)
        return False

    def before_reducing_backward(self, loss: torch.Tensor, anchors: list = ()) -> None:
        """The first reducing backward: discover only if `loss`'s graph, with the nodes backward also runs
        from (`anchors`: stage 3's, anchors.py), can deliver pieces (module note). A reentrant region
        only an anchor reaches on this rank counts as on the ranks whose loss uses it: a rank that
        discovered nothing launched its buckets mid-backward while the others held theirs (a hang)."""
        if not self.discovering:
            return
        reason = pieces_reason(loss, self.names or None, anchors)
        if reason is None:
            self.discovering = False
            region_params.done(self)
        elif not dist.is_initialized() or dist.get_rank() == 0:  # one line per job
            warnings.warn(f"ZeRO: this run's first backward keeps the model's whole gradient until it ends (no "
                          f"overlap) because of {reason}, which may deliver a "
                          "gradient in pieces; torch.utils.checkpoint(..., use_reentrant=False), or "
                          "engine.checkpointing.checkpoint with no parameter in two regions, avoids it",
                          stacklevel=4)

    def end_pass(self) -> None:
        self._this_pass.clear()
        self.discovering = False
        region_params.done(self)

    def end_window(self) -> None:
        self.window.clear()

    def name(self, param: torch.nn.Parameter) -> str:
        return self.names.get(param, f"<parameter of shape {tuple(param.shape)}>")

    def late_gradient(self, stage: int, param: torch.nn.Parameter) -> RuntimeError:
        return RuntimeError(
            f"ZeRO stage {stage}: parameter {self.name(param)} got another gradient in this backward after "
            "its bucket was reduced, which the first backward of this run did not show (the set of "
            "parameters used more than once, e.g. by reentrant checkpointing, changed between steps); "
            "use torch.utils.checkpoint(..., use_reentrant=False), or use such parameters from the first step")

    def check_unused(self, params: list[torch.nn.Parameter], ignore_unused: bool) -> None:
        """`zero_optimization.ignore_unused_parameters: false`: a trainable parameter without a gradient in
        the whole accumulation window is an error (as in DeepSpeed); with true it counts as zero (DDP)."""
        if ignore_unused:
            return
        missing = [self.name(p) for p in params if p not in self.window]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(
                f"zero_optimization.ignore_unused_parameters is false and {len(missing)} trainable parameter(s) "
                f"got no gradient in this step: {shown}; use them in the forward pass, freeze them "
                "(requires_grad=False), or set ignore_unused_parameters to true (their gradient counts as zero)")


def dense_view(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`flat` (numel of `like`) viewed with `like`'s strides, so a gradient or master weight has its
    parameter's memory layout (a transposed weight, channels_last): fused optimizers pair elements of
    a parameter and its gradient by memory position, not by index. `like` must be dense."""
    return flat.as_strided(like.shape, like.stride())


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and without gaps: its elements fill numel() consecutive memory slots in some order."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def may_arrive_twice(loss: torch.Tensor, tracked=None) -> bool:
    """Whether `loss`'s autograd graph may deliver some parameter's gradient in pieces (module note: when
    to discover). `tracked`: as for `pieces_reason`."""
    return pieces_reason(loss, tracked) is not None


def _delivers_once(cls) -> bool:
    """dstrain's marked Functions, and torch.compile's AOTAutograd graphs (`engine.compile()`): their
    backward runs the compiled backward graph once, no backward of its own."""
    return getattr(cls, "delivers_gradients_once", False) or (
        cls.__name__ == "CompiledFunction" and cls.__module__.startswith("torch._functorch."))


def pieces_reason(loss: torch.Tensor, tracked=None, anchors: list = ()) -> str | None:
    """What in `loss`'s graph may deliver a parameter's gradient in pieces, or None: a Python Function node
    that may run a backward of its own, or a parameter used in two places among dstrain's reentrant
    regions and the rest of the graph (region_params.py's note). `tracked`: the parameters whose
    gradients are hooked (others, such as a ZeRO-3 flat partition that a region's gather reads, get no
    gradient from autograd and do not count); None counts every one. `anchors`: more root nodes."""
    places: dict[torch.nn.Parameter, int] = {}  # where each parameter is used: regions, plus 1 outside them
    for node in graph_nodes([loss.grad_fn, *anchors]):
        if _own_backward(node):
            used = region_params.recorded(node)
            if used is None:
                return f"a {type(node).__name__} node (a Python autograd Function that may run a backward of its own)"
            for p in used:
                places[p] = places.get(p, 0) + 1
        elif hasattr(node, "variable"):  # AccumulateGrad: the uses outside the regions, summed by autograd
            places[node.variable] = places.get(node.variable, 0) + 1
    shared = [p for p, n in places.items() if n > 1 and (tracked is None or p in tracked)]
    if not shared:
        return None
    name = (tracked or {}).get(shared[0], f"of shape {tuple(shared[0].shape)}")
    return f"parameter {name} (in two reentrant checkpoint regions, or in one and outside them)"


def graph_nodes(roots: list):
    """Every autograd node reachable from `roots` (nodes; None is skipped), each once."""
    seen, todo = set(), list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(nxt for nxt, _ in node.next_functions)


def _own_backward(node) -> bool:
    """A Python Function node that may run a backward of its own (module note: when to discover)."""
    return isinstance(node, torch.autograd.function.BackwardCFunction) and not _delivers_once(node._forward_cls)


def reach_fingerprint(roots: list, index: dict[torch.nn.Parameter, int]) -> int:
    """A 52-bit digest (exact in a float64) of which parameters of `index` (parameter -> position) the
    graph behind `roots` gives a gradient, for ranks to compare (prefetch.py's note: reductions wait).
    A reentrant region counts with the parameters it recorded, or as one opaque region where it recorded
    none: what it uses inside is not seen."""
    reached, opaque = set(), 0
    for node in graph_nodes(roots):
        if _own_backward(node):
            used = region_params.recorded(node)
            if used is None:
                opaque += 1
            else:
                reached.update(index[p] for p in used if p in index)
        elif getattr(node, "variable", None) in index:  # AccumulateGrad of a tracked parameter
            reached.add(index[node.variable])
    data = struct.pack(f"<{len(reached) + 1}q", opaque, *sorted(reached))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12
