"""Parameters a region's owner holds directly: where its forward uses them is read from the autograd graph.

[Note: own parameters] region_params.py sees a child used inside a column→row region by the child's
own forward. A parameter the owner holds itself (or through a child that holds one of the pair's
layers too: dropout_region.py's BERT layout) has no forward to see it by: a per-head-dim scale
applied to every head of q (DiffLlama's `lambda_q1`, a learned temperature), a bias added to the
column projection's output. Used inside a region, each tensor rank's gradient is its heads' share
(a per-head-dim scale on 4 heads split over 2 ranks: each rank's gradient was half the dense one's
and the copies drifted apart, silently), so it is summed over the tensor group like a child's.
Used only before the first column-parallel projection or after a row-parallel one it is replicated
data with the dense gradient on every rank: nothing to do (an `out_bias` of the hidden size added
after o_proj was refused at initialize for being as wide as a column projection: a false refusal).
Used in both, the gradient is a share plus a whole, which neither summing nor leaving can make
the dense one: refused with an error naming it.
Which: at the owner's first forward with gradients enabled (a recompute counts) the autograd graph is
walked once. The column layers' outputs, the row layers' outputs and the owner's inputs cut it into
segments; the walks back from the row layers' inputs cover the regions, the walks back from the
owner's output (its first tensor: HF attention returns its partitioned attention weights second) and
from the column layers' inputs cover the rest. The hooks then remove themselves: a forward after that
costs nothing. An owner without trainable parameters of its own gets no hooks at all.
A parameter spanning the column projection's whole output used inside a region meets one rank's
share of it: torch raises a shape error that names no parameter; the note added to it names them.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from .kv_heads import KeyValueHeadLinear
from .layers import ColumnParallelLinear, RowParallelLinear
from .region_params import region_is_open, sum_gradient_over


def _grad_nodes(tensors) -> list:
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _first_tensor(output):
    while isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output


def _walk(roots: list, stops: set) -> dict:
    """Every node reachable from `roots` without crossing a stop -> the nodes reached that consume it."""
    users: dict = {}
    todo = [(node, None) for node in roots]
    while todo:
        node, user = todo.pop()
        if node is None or node in stops:
            continue
        seen = node in users
        users.setdefault(node, [])
        if user is not None:
            users[node].append(user)
        if not seen:
            todo.extend((n, node) for n, _ in node.next_functions)
    return users


def _leaves(roots: list, stops: set) -> set[int]:
    """ids of the leaf tensors (AccumulateGrad nodes) reachable from `roots` without crossing a stop."""
    return {id(node.variable) for node in _walk(roots, stops) if getattr(node, "variable", None) is not None}


class _Graph:
    """The nodes one forward of the owner recorded (module note)."""

    def __init__(self):
        self.armed = False
        self.stops, self.inside_roots, self.outside_roots = set(), [], []


def _refuse_mixed(owner: nn.Module, name: str, p: torch.Tensor):
    raise ValueError(f"tensor parallelism: {type(owner).__name__}.{name} {tuple(p.shape)} is used both inside a "
                     "column→row region (on this rank's heads) and outside it (on the whole width): its gradient is a "
                     "share plus a whole, which no reduction makes the dense one; use it on one side only, or leave "
                     "tensor_parallel.autotp_size at 1 for this model")


def _refuse_whole_width(owner: nn.Module, name: str, p: torch.Tensor):
    raise ValueError(f"tensor parallelism: {type(owner).__name__}.{name} {tuple(p.shape)} spans a column-parallel "
                     "layer's whole output and is used inside the region on one rank's share of it; leave "
                     "tensor_parallel.autotp_size at 1 for this model, or shard it with engine.tensor_parallel's layers")


def _own_parameters(owner: nn.Module, parallel: list[nn.Module]) -> dict[str, nn.Parameter]:
    """The trainable parameters the owner holds itself, or through a child that also holds one of its
    parallel layers (dropout_region.py's note: the smallest module that runs the pair); a child without
    parallel layers is region_params.py's. The parallel layers' own parameters are theirs."""
    layers = [m for m in owner.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, KeyValueHeadLinear))]
    taken = {id(p) for m in layers for p in m.parameters()}
    own = {name: p for name, p in owner.named_parameters(recurse=False) if p.requires_grad}
    for child_name, child in owner.named_children():
        if set(child.modules()) & set(parallel):
            own.update({f"{child_name}.{name}": p for name, p in child.named_parameters()
                        if p.requires_grad and id(p) not in taken})
    return own


def watch_own_parameters(owner: nn.Module, column: list[nn.Module], row: list[nn.Module], widths: set[int]) -> None:
    """Find where `owner`'s own trainable parameters are used at its first forward with gradients
    (module note); sum the gradients of those used inside a region over the tensor group."""
    own = _own_parameters(owner, column + row)
    if not own:
        return
    comm, graph, handles = column[0].comm, _Graph(), []
    wide = [name for name, p in own.items() if p.numel() in widths]

    def start(module, args, kwargs) -> None:
        graph.armed = torch.is_grad_enabled()
        if graph.armed:
            graph.stops |= set(_grad_nodes([*args, *kwargs.values()]))

    def column_output(module, args, output) -> None:
        if graph.armed:
            graph.stops |= set(_grad_nodes([output]))
            graph.outside_roots += _grad_nodes(args[:1])

    def row_input(module, args) -> None:
        if graph.armed:
            graph.inside_roots += _grad_nodes(args[:1])

    def row_output(module, args, output) -> None:
        if graph.armed:
            graph.stops |= set(_grad_nodes([output]))

    def end(module, args, output) -> None:
        if not graph.armed:
            return
        graph.armed = False
        inside = _leaves(graph.inside_roots, graph.stops)
        outside = _leaves(graph.outside_roots + _grad_nodes([_first_tensor(output)]), graph.stops)
        graph.stops, graph.inside_roots, graph.outside_roots = set(), [], []  # the graph is the caller's
        for name, p in own.items():
            if id(p) in inside and id(p) in outside:
                _refuse_mixed(owner, name, p)
            if id(p) in inside and name in wide:
                _refuse_whole_width(owner, name, p)
        for name, p in own.items():
            if id(p) in inside:
                sum_gradient_over(p, comm)
        for handle in handles:
            handle.remove()

    handles.append(owner.register_forward_pre_hook(start, with_kwargs=True))
    handles += [layer.register_forward_hook(column_output) for layer in column]
    handles += [layer.register_forward_pre_hook(row_input) for layer in row]
    handles += [layer.register_forward_hook(row_output) for layer in row]
    handles.append(owner.register_forward_hook(end))
    if wide:
        note_region_failures(owner, wide, "as wide as a column-parallel layer's whole output; used inside the "
                                          "region it meets one rank's share of it")


def note_region_failures(owner: nn.Module, names: list[str], why: str) -> None:
    """An error raised inside a region of an owner holding parameters that may not fit one rank's share
    gets a note naming them and `why` (module note); the region flag is still set: the owner's end hook
    runs after this one. One note per error."""
    def noted(module, args, output) -> None:
        error = sys.exc_info()[1]
        if error is not None and region_is_open() and not getattr(error, "_tensor_parallel_noted", False):
            error._tensor_parallel_noted = True
            error.add_note(f"tensor parallelism: {type(owner).__name__} holds {', '.join(names)}, {why}. Leave "
                           "tensor_parallel.autotp_size at 1 for this model, or shard it with "
                           "engine.tensor_parallel's layers")
    owner.register_forward_hook(noted, always_call=True, prepend=True)


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "ReshapeAliasBackward0")


def _reads_part(node, size: int) -> bool:
    """Whether the autograd node `node`, which consumes a tensor of `size` elements, reads part of it."""
    name = type(node).__name__
    if name == "SliceBackward0":
        return min(node._saved_end, node._saved_self_sym_sizes[node._saved_dim]) - node._saved_start < \
            node._saved_self_sym_sizes[node._saved_dim]
    return name in ("SelectBackward0", "IndexBackward0", "NarrowBackward0", "SplitBackward0", "UnbindBackward0")


def refuse_partial_reads(owner: nn.Module, names: list[str]) -> None:
    """At the owner's first forward with gradients, refuse a parameter of `names` (as long as head_dim and
    as a head count: autotp.py's note on head-sized parameters) that the forward reads in part (sliced,
    indexed): one entry per head, cut by the divided head count (`p[:self.num_heads]`), which on every
    rank reads the first heads' entries. Read whole it is a per-head-dim scale, which trains exactly."""
    params = {name: p for name, p in owner.named_parameters(recurse=False) if name in names and p.requires_grad}
    if not params:
        return
    inputs: set = set()

    def start(module, args, kwargs) -> None:
        inputs.clear()
        inputs.update(_grad_nodes([*args, *kwargs.values()]))

    def end(module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        for handle in handles:  # once: the graph's shape does not change between forwards
            handle.remove()
        consumers = _walk(_grad_nodes([_first_tensor(output)]), inputs)
        names = {id(p): name for name, p in params.items()}
        accumulate = {node: names[id(node.variable)] for node in consumers  # a parameter's AccumulateGrad node
                      if id(getattr(node, "variable", None)) in names}
        for node, name in accumulate.items():
            frontier = list(consumers.get(node, []))
            while frontier:
                user = frontier.pop()
                if type(user).__name__ in _VIEWS:
                    frontier += consumers.get(user, [])
                elif _reads_part(user, params[name].numel()):
                    raise ValueError(f"tensor parallelism: {type(owner).__name__}.{name} {tuple(params[name].shape)} is "
                                     "as long as head_dim and as a head count, and its forward reads part of it "
                                     f"({type(user).__name__}): one entry per head, indexed by the divided head count, "
                                     "would meet every rank's heads with the first heads' entries; leave "
                                     "tensor_parallel.autotp_size at 1 for this model, or shard it with "
                                     "engine.tensor_parallel's layers")
    handles = [owner.register_forward_pre_hook(start, with_kwargs=True), owner.register_forward_hook(end)]

