"""Which modules gather which parameters at ZeRO stage 3, and the hooks that tell the coordinator.

[Note: units] A *unit* gathers, in one all-gather, every partitioned parameter of its subtree that no
nested unit owns (FSDP2's grouping). Units are the root module and every child of an `nn.ModuleList`,
`nn.Sequential` or `nn.ModuleDict` (the repeated layers of a model). So a parameter used anywhere
inside its unit's forward is available there — also outside its own module's forward (a GPT's
`x @ self.tok.weight.t()` in the root). A parameter shared by two units belongs to the first one in
module order; a module elsewhere that holds it directly, or registered it with
`register_external_parameter`, becomes a *user* of that unit's group, with its own hooks (tied
weights across blocks, a block reading another block's weight).
[Note: hooks] Forward pre-hook: gather (and prefetch). Forward hook: release, and hook the outputs so
that the first gradient reaching them gathers again before the module's backward. The module's
inputs pass through `_PostBackward`, whose backward runs once the module's backward is done: release.
When no input needs a gradient that never fires, and the end of backward releases instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from offload.host_heap import forward_in_heap

from .init import external_parameters

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    owned: list = field(default_factory=list)  # parameters this unit owns (persistent ones included)
    groups: list = field(default_factory=list)  # GatherGroups gathered around its forward/backward


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def discover_units(root: nn.Module) -> list[Unit]:
    """Units in module (pre-)order with the parameters each owns (see the module note)."""
    names = {m: n for n, m in root.named_modules(remove_duplicate=True)}
    modules = [root] + [c for m in root.modules() if isinstance(m, CONTAINERS) for c in m.children()
                        if _has_params(c)]
    order = {m: i for i, m in enumerate(root.modules())}
    unit_modules = sorted(dict.fromkeys(modules), key=lambda m: order[m])
    units = [Unit(i, names[m] or "<root>", m) for i, m in enumerate(unit_modules)]
    is_unit = set(unit_modules)
    assigned: set = set()

    def collect(unit: Unit, m: nn.Module) -> None:
        for p in m._parameters.values():
            if p is not None and p not in assigned:
                assigned.add(p)
                unit.owned.append(p)
        for child in m.children():
            if child not in is_unit:
                collect(unit, child)

    for unit in units:
        collect(unit, unit.module)
    return units


def user_modules(root: nn.Module, units: list[Unit], group_of: dict) -> list[tuple[str, nn.Module, list]]:
    """(name, module, groups) of modules that directly hold, or registered as external
    (`engine.zero.register_external_parameter`), a partitioned parameter whose group no unit enclosing
    them gathers (a weight tied across units, a block reading another block's weight)."""
    unit_of = {u.module: u for u in units}
    found = []

    def walk(m: nn.Module, name: str, active: set) -> None:
        if m in unit_of:
            active = active | {g.gid for g in unit_of[m].groups}
        held = [p for p in m._parameters.values() if p is not None] + external_parameters(m)
        needed = {group_of[p] for p in held if p in group_of}
        missing = [g for g in needed if g.gid not in active]
        if missing:
            found.append((name, m, sorted(missing, key=lambda g: g.gid)))
            active = active | {g.gid for g in missing}
        for child_name, child in m.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, active)

    walk(root, "", set())
    return found


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward marks the end of that module's backward."""

    delivers_gradients_once = True  # its backward runs a callback, no backward of its own (arrivals.py)

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def install_hooks(module: nn.Module, index: int, coordinator) -> list:
    """Forward pre/post hooks on `module` reporting unit `index` to `coordinator` (module note: hooks)."""

    def pre(mod, args):
        coordinator.pre_forward(index)
        if not torch.is_grad_enabled():
            return None
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not slots:
            return None
        wrapped = _PostBackward.apply(lambda: coordinator.post_backward(index), *[args[i] for i in slots])
        args = list(args)
        for i, t in zip(slots, wrapped):
            args[i] = t
        return tuple(args)

    def post(mod, args, output):
        tensors = []
        if torch.is_grad_enabled():  # noted first: the root's end of forward compares what its outputs reach
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            coordinator.note_outputs(tensors)
        coordinator.post_forward(index)
        call = {"done": False}

        def pre_backward(grad):
            if not call["done"]:
                call["done"] = True
                coordinator.pre_backward(index)
        for t in tensors:
            t.register_hook(pre_backward)
        return None

    # torch.compile: the hooks run eagerly, graph breaks around the compiled model code (DeepSpeed disables
    # its hooks too). Traced, dynamo inlined the coordinator's bookkeeping (locks, digests, collectives) up to
    # each break: 16 graphs and ~10 s of CPU per rank for a 3-layer model against 1, and with its parameters
    # partitioned the first backward failed (a gathered weight "modified by an inplace operation")
    pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)
    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    if index == 0:  # a root forward that raised skips `post`: the reentrant-region wrapper (anchors.py) goes
        # anyway, else it stayed on torch's CheckpointFunction, holding the failed pass's graph, until
        # this engine's next pass or destroy (never, for an engine dropped after an OOM); and glibc's
        # threshold is bounded again (offload/host_heap.py's fourth note), else the forward's stayed on
        # for whatever the process did next until a later forward ended
        def ended(mod, args, output):
            forward_in_heap(False)
            coordinator.anchors.close()
        handles.append(module.register_forward_hook(torch.compiler.disable(ended), always_call=True))
    return handles
