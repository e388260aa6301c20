"""`policy: "selective_unpack"` (dstrain): no checkpoint region at all. The block runs once, as the plain
model; what autograd would save of a cheap op's output (views, layer norms, GELU, copies) and of a
widening matmul's (an MLP's up projection) is replaced by how to make it again, and backward remakes
it when it unpacks it.

[Note: why not a checkpoint region] A checkpointed block runs its whole Python forward again in
backward (modules, autograd graph, the checkpoint's hooks on every saved tensor) even where a selective
policy answers every op from its cache: on the example GPT on one CPU thread that alone was a quarter
to a half of full checkpointing's overhead (bench_long_sequence's `save_every_op` row), which with the
up projection recomputed (0.4 of full's recomputed work) keeps a region's selective rule above half of
full's overhead (issue 19). Here only the dropped ops run again, each once, from the exact arguments
the forward gave them; the forward pays a Python dispatch mode on every op and a hook per saved tensor.

[Note: how] While the block's forward runs, a dispatch mode records the op and arguments that made
each output of a recomputable op, by its storage and view geometry; saved-tensor hooks then pack a
saved tensor so made as a `_Remade` (the op, its arguments packed the same way) and anything else as
it is (`_Held`, with its version: an in-place change before backward is an error, as autograd's own).
A `_Remade` keeps its result until autograd drops it, so the up projection that both GELU's and the
down projection's backward need runs once. Arguments a recipe holds are what autograd saves anyway
(the layer norm's input, the up projection's input, parameters), so the dropped outputs are freed.
A recipe may hold an input autograd itself would not keep (a copy's: `h.transpose().contiguous()`),
which the forward may then change in place, as plain autograd allows: an op about to write a tensor
a recipe of the running region holds makes that recipe first and keeps its output (the memory of
plain autograd there). A change after the region's forward ended (in a later block) is not seen:
backward then reports it, naming `policy`.
Ops that draw random numbers are never recomputed (dropout is held as the plain model holds it),
so the RNG needs no replay; the recomputed kernels are the forward's, on the same inputs: exact.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import probe as probes
from .policy import _MATMULS, _widening
from .recompute_probe import recomputing

_aten = torch.ops.aten
CHEAP = frozenset(getattr(_aten, name) for name in ("gelu", "native_layer_norm", "clone", "_unsafe_view", "contiguous")
                  if hasattr(_aten, name))


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


_NEVER, _ALWAYS, _IF_WIDENING, _VIEW = 0, 1, 2, 3
_KINDS: dict = {}  # op -> which of the four: the forward asks for every op it runs


def _kind(func) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        # detach: its output is its input's geometry, never recorded (the pack hooks' own detaches, too)
        kind = _KINDS[func] = (_NEVER if func.overloadpacket is _aten.detach else
                               _VIEW if func.is_view or func.overloadpacket is _aten._unsafe_view else
                               _ALWAYS if func.overloadpacket in CHEAP else
                               _IF_WIDENING if func.overloadpacket in _MATMULS else _NEVER)
    return kind


def _view_worth_recording(made: dict, args) -> bool:
    """A view is remade only from a tensor that is remade too (recorded here) or from a parameter (read
    as it is in backward: ZeRO-3 gathers it again); a view of a tensor held anyway costs nothing to
    hold, and remaking it would be Python work for no memory."""
    a = args[0] if args else None
    return isinstance(a, torch.Tensor) and ((a.grad_fn is None and a.requires_grad) or _key(a) in made)


class _Region:
    """One block's forward (or the model's, outside its blocks): by `_key`, the call (op, arguments
    and their versions) that made each output of a recomputable op, and which of its outputs it is;
    and the `_Call`s its packs share."""

    __slots__ = ("made", "calls")

    def __init__(self):
        self.made: dict = {}
        self.calls: dict = {}  # id of a recorded call -> its _Call

    def record(self, func, args, kwargs, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        call = (func, args, kwargs, tuple(a._version if isinstance(a, torch.Tensor) else None for a in args))
        # a view with an input's own geometry is that input: keep the input's maker
        inputs = {_key(a) for a in args if isinstance(a, torch.Tensor)} if func.is_view else ()
        for index, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                key = _key(t)
                # the entry holds the output until the region's forward ends, so that no later
                # tensor is given its memory (and with it its key)
                if key not in inputs and key not in self.made:
                    self.made[key] = (call, index if outs is out else None, t._version, t)

    def before_in_place(self, func, args, kwargs) -> None:
        """`func` is about to change tensors in place: a recipe holding one of them (a copy's input,
        which autograd itself need not keep unchanged) is made now, from what it read, and kept."""
        written = _written(func, args, kwargs)
        for call in self.calls.values():
            if call.out is None and any(isinstance(a, _Held) and a.tensor.untyped_storage().data_ptr() in written
                                        for a in call.args):
                call.result()

    def pack(self, t: torch.Tensor):
        entry = self.made.get(_key(t))
        if entry is None or entry[2] != t._version:  # not made by a recomputable op, or changed since
            return _Held(t)
        (func, args, kwargs, versions), index, _, _ = entry
        if any(isinstance(a, torch.Tensor) and a._version != v for a, v in zip(args, versions)):
            return _Held(t)  # an input changed in place since: the op would not make t again
        call = self.calls.get(id(entry[0]))
        if call is None:
            call = self.calls[id(entry[0])] = _Call(
                func, [self.pack(a) if isinstance(a, torch.Tensor) else a for a in args], kwargs)
        return _Remade(call, index)


_WRITES: dict = {}  # op -> the positions and names of the arguments it writes


def _write_positions(func) -> list:
    positions = _WRITES.get(func)
    if positions is None:
        positions = _WRITES[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                                     if a.alias_info is not None and a.alias_info.is_write]
    return positions


def _written(func, args, kwargs) -> set:
    """The storages (data pointers) of the tensors `func` writes in place."""
    found = (args[i] if i < len(args) else kwargs.get(name) for i, name in _write_positions(func))
    return {t.untyped_storage().data_ptr() for t in found if isinstance(t, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    """Records each recomputable op's call into the region whose forward runs now (`region`)."""

    def __init__(self, region: _Region):
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.region.calls and _write_positions(func):
            self.region.before_in_place(func, args, kwargs)
        out = func(*args, **kwargs)
        kind = _kind(func)
        # nothing made under no_grad (ZeRO-3's gathers in the blocks' hooks, which run inside the model's
        # region) is recorded: no tensor of it is kept alive to the region's end for a backward
        if kind == _NEVER or not torch.is_grad_enabled() or (kind == _IF_WIDENING and not _widening(func, args)) or \
                (kind == _VIEW and not _view_worth_recording(self.region.made, args)):
            return out
        self.region.record(func, args, kwargs, out)
        return out


class _Held:
    """A saved tensor kept as it is, with what the active probes count for it."""

    __slots__ = ("tensor", "version", "tokens")

    def __init__(self, t: torch.Tensor):
        # a computed tensor is held detached (autograd gives the unpacked one its graph place back):
        # holding an output its own node saves would make a cycle through that node, and a forward
        # without a backward would leak it. A leaf (a parameter) is held itself, as autograd does,
        # so that a parameter whose data is swapped (ZeRO-3's gather) is read as it is in backward.
        self.tensor = t.detach() if t.grad_fn is not None else t
        self.version = t._version
        self.tokens = [p._pack(self.tensor) for p in probes._ACTIVE]  # each probe counts the storage once

    def value(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("activation_checkpointing.policy 'selective_unpack': a tensor backward needs was "
                               "changed in place after the forward; use policy 'full' or 'selective' for this module")
        return self.tensor


class _Call:
    """A recomputable op's call, made again (once) when backward first needs one of its outputs."""

    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, None

    def result(self):
        if self.out is None:
            args = [_unpack(a) for a in self.args]
            with torch.no_grad(), recomputing():  # RecomputeProbe counts what runs again
                self.out = self.func(*args, **self.kwargs)
        return self.out


class _Remade:
    """A saved tensor dropped in forward: output `index` of a `_Call` (None: its only output)."""

    __slots__ = ("call", "index")

    def __init__(self, call: _Call, index):
        self.call, self.index = call, index

    def value(self) -> torch.Tensor:
        out = self.call.result()
        return out if self.index is None else out[self.index]


def _unpack(packed):
    return packed.value() if isinstance(packed, (_Held, _Remade)) else packed


_LOCAL = threading.local()  # .recorder: the outermost region's, while a forward runs (modes and hooks are per thread)


@contextlib.contextmanager
def recompute_on_unpack():
    """Run a module's forward under this: its cheap and widening ops' saved outputs are dropped and
    remade in backward (module note). Nested (a block inside a model that runs under it too), the
    inner forward is a region of its own: what it records is let go when it ends, and the ops around
    it are the outer region's."""
    region = _Region()
    recorder = getattr(_LOCAL, "recorder", None)
    if recorder is not None:  # one dispatch mode and one pair of hooks for all regions: switch which records
        outer, recorder.region = recorder.region, region
        try:
            yield
        finally:
            recorder.region = outer
        return
    recorder = _Recorder(region)
    # autograd keeps the pack hook with every tensor it saved: a hook holding the recorder (and through
    # it the recorded outputs and their nodes) would make a cycle through those nodes, leaked by a
    # forward without a backward. The hook reaches the recorder weakly; this frame keeps it alive.
    ref = weakref.ref(recorder)
    _LOCAL.recorder = recorder
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ref().region.pack(t), _unpack), recorder:
            yield
    finally:
        _LOCAL.recorder = None
