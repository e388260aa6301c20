"""`engine.zero.Init`, `engine.zero.GatheredParameters` and `engine.zero.register_external_parameter`
(DeepSpeed's `deepspeed.zero` names).

    with engine.zero.Init(config=ds_config):
        model = MyModel()                  # each module's parameters are partitioned as it is built
    with engine.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.normal_()    # rank 0's edit reaches every rank's partition on exit

[Note: construction] Inside `Init`, every `nn.Module` subclass's `__init__` is wrapped: when the
outermost `__init__` of a module returns, the parameters it registered directly are broadcast from rank
0 (so all ranks agree whatever their random state), this rank keeps its dim-0 chunk (`p._z3_chunk`,
padded, in the config's model dtype), and `p.data` becomes an empty placeholder (`p.ds_shape` keeps
the shape; the placeholder keeps its number of dimensions, stage3_params.placeholder). So at most one
module's own parameters exist in full at a time. `Module.apply` is wrapped too
(`override_module_apply`): `fn` sees each module's parameters gathered, and rank 0's result is kept —
which is what makes `self.apply(init_weights)` at the end of a model's `__init__` work.
`initialize()` then builds the stage-3 partition from the chunks without materializing the model.
[Note: which group] Without `data_parallel_group` the parameters are partitioned over the data axis of
the current topology when one splits the world further (tensor parallelism, set with
`engine.topology.set_current` before the model is built: the ranks that hold the same shard), else over
the world: the group stage 3 partitions over at `initialize`. `GatheredParameters` of a parameter no
engine owns yet gathers over the same default.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging

import torch
import torch.nn as nn

import schemas

from ..comm import Communicator
from ..precision import model_dtype
from offload.chunk_file import SwappedChunk
from .param_nvme import init_chunk_file
from .init_edits import (check_no_lost_edit, mark_placeholder, patch_init_functions, patch_smart_apply,
                         placeholder_index_error, wrap_reset_parameters)
from .param_copy import copyable_when_partitioned
from .stage3_params import (chunk_tensor, full_shape, gather_full, padded_chunk, placeholder, replaced_error,
                            spec_of)

logger = logging.getLogger(__name__)


def _subclasses(cls) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def default_communicator() -> Communicator:
    """The data axis of a model-parallel topology, else the world (module note: which group)."""
    from ..topology import model_parallel_if_set
    groups = model_parallel_if_set()
    return Communicator(groups.data_group if groups is not None else None)


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_shape") and tuple(p.shape) != tuple(p.ds_shape)


def _refuse_unbuilt_init_arguments(checks: dict[str, tuple[bool, str]], given: dict) -> None:
    refused = [f"{name}={given[name]!r} ({feature})" for name, (fine, feature) in checks.items() if not fine]
    if refused:
        raise NotImplementedError(f"engine.zero.Init: {', '.join(refused)} not built yet in dstrain; "
                                  "leave these arguments at their defaults")


class Init:
    """Partition parameters as modules are constructed (module note: construction)."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group=None, param_swapper=None):
        # DeepSpeed's signature, so its callers run unchanged; what is not built is refused, not dropped.
        # mem_efficient_linear is met by construction (zero_optimization.memory_efficient_linear's note).
        _refuse_unbuilt_init_arguments({
            "remote_device": (remote_device in (None, "none", "cpu", "nvme"), "that remote device"),
            "mpu": (mpu is None, "Megatron-style model parallelism"),
            "zero_param_parallel_group": (zero_param_parallel_group is None, "ZeRO++ hpZ"),
            "zero_quantized_weights": (not zero_quantized_weights, "ZeRO++ qwZ"),
            "zero_quantized_nontrainable_weights": (not zero_quantized_nontrainable_weights,
                                                    "ZeRO++ quantized frozen weights"),
            "sequence_data_parallel_group": (sequence_data_parallel_group is None, "sequence parallelism"),
            "param_swapper": (param_swapper is None, "NVMe parameter swapping"),
        }, locals())
        self.enabled = enabled
        self.comm = Communicator(data_parallel_group) if data_parallel_group is not None else default_communicator()
        source = config if config is not None else config_dict_or_path
        cfg = schemas.load_config(source, world_size=self.comm.world_size) if source is not None else None
        self.dtype = dtype or (model_dtype(cfg) if cfg is not None else None)
        self.module = module
        # remote_device "cpu": chunks are kept in host memory from the start (pinned next to an
        # accelerator when asked), so the model is never whole on the device (tier.py's stage-3 note).
        self.chunk_device = torch.device("cpu") if remote_device in ("cpu", "nvme") else self.comm.device
        self.pin = pin_memory and remote_device == "cpu" and self.comm.device.type != "cpu"
        # remote_device "nvme": each chunk goes to a file as its module is built (param_nvme.py's note)
        self.chunk_file = init_chunk_file(cfg, self.comm.rank) if remote_device == "nvme" and enabled else None
        self._freed = 0  # bytes of full parameters freed since the heap was last handed back
        self._patched: list[tuple[type, str, object]] = []
        self._placeholders: list[torch.nn.Parameter] = []  # partitioned here (init_edits.py's note)
        self._warned_meta = False

    def partition(self, module: nn.Module) -> None:
        """Partition the parameters `module` holds directly (not its children's)."""
        for p in module._parameters.values():
            if p is None or hasattr(p, "ds_shape"):
                continue
            if p.is_meta:  # no values to partition (the note on meta parameters)
                self._warn_meta(module)
                continue
            with torch.no_grad():
                # On the communicator's device: the broadcast needs it there, and so does the chunk kept
                # (a chunk left on the host would put the fp32 partition there).
                dtype = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
                p.data = p.data.to(device=self.comm.device, dtype=dtype)
                self.comm.broadcast(p.data, src=0)
                spec = spec_of(tuple(p.shape), self.comm.world_size)
                p.ds_shape = p.shape
                chunk = padded_chunk(p.data, spec, self.comm.rank)
                if chunk.device != self.chunk_device:
                    chunk = chunk.to(self.chunk_device).pin_memory() if self.pin else chunk.to(self.chunk_device)
                p._z3_chunk = self.chunk_file.put(chunk) if self.chunk_file is not None else chunk
                self._note_freed(p.numel() * p.element_size())
                p.data = placeholder(tuple(p.ds_shape), p.dtype, p.device)
                mark_placeholder(p)
                copyable_when_partitioned(p)  # param_copy.py: nn.TransformerEncoder's clones, EMA copies
                self._placeholders.append(p)

    def _warn_meta(self, module: nn.Module) -> None:
        """[Note: meta parameters] transformers' `from_pretrained` builds its model on the meta device and
        loads the checkpoint's tensors in their place afterwards, so inside Init there is nothing to
        broadcast or chunk. Such parameters are left whole: the model loads as it would outside Init and
        `engine.initialize` partitions it (the full model is then in memory on every rank while it
        loads). Said once per Init."""
        if not self._warned_meta:
            self._warned_meta = True
            logger.warning("engine.zero.Init: %s has parameters on the meta device (transformers' from_pretrained "
                           "builds on meta); they are left whole and engine.initialize partitions them once "
                           "loaded, so the full model is in memory on every rank while it loads",
                           type(module).__name__)

    @contextlib.contextmanager
    def _filled_whole(self, params: list):
        """`params` whole inside, rank 0's values kept (Module.apply, torch.nn.init: init_edits.py)."""
        with GatheredParameters(params, modifier_rank=0, comm=self.comm):
            yield
        self._note_freed(sum(torch.Size(full_shape(p)).numel() * p.element_size() for p in params))

    def _note_freed(self, nbytes: int) -> None:
        """Full parameters were freed: hand the heap back every TRIM_BYTES (the note on Init's heap)."""
        self._freed += nbytes
        if self.chunk_file is not None and self._freed > TRIM_BYTES:
            _return_freed_heap()
            self._freed = 0

    def _wrap_init(self, cls: type) -> None:
        self._patched += wrap_reset_parameters(cls, self._filled_whole)
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_z3_wrapped", False):
            return
        ctx = self

        def __init__(module, *args, **kwargs):
            outermost = not getattr(module, "_z3_constructing", False)
            if outermost:
                object.__setattr__(module, "_z3_constructing", True)
            try:
                original(module, *args, **kwargs)
            except IndexError as e:  # init_edits.py's note: an index into a placeholder
                error = placeholder_index_error(e, module.parameters(), f"{type(module).__name__}.__init__")
                if outermost and error is not None:
                    raise error from e
                raise
            finally:
                if outermost:
                    object.__delattr__(module, "_z3_constructing")
            if outermost:
                check_no_lost_edit(((f"'{n}'", p) for n, p in module.named_parameters()),
                                   f"{type(module).__name__}.__init__")
                ctx.partition(module)
        __init__._z3_wrapped = True
        self._patched.append((cls, "__init__", original))
        cls.__init__ = __init__

    def __enter__(self):
        if not self.enabled:
            return self
        if self.module is not None:
            for m in self.module.modules():
                self.partition(m)
        for cls in [nn.Module] + _subclasses(nn.Module):
            self._wrap_init(cls)
        ctx, original_subclass_hook = self, nn.Module.__dict__.get("__init_subclass__")

        @classmethod
        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            ctx._wrap_init(cls)
        self._patched.append((nn.Module, "__init_subclass__", original_subclass_hook))
        nn.Module.__init_subclass__ = __init_subclass__
        original_apply = nn.Module.apply

        def apply(module, fn):
            for child in module.children():
                child.apply(fn)
            with ctx._filled_whole(list(module.parameters(recurse=False))):
                fn(module)
            return module
        self._patched.append((nn.Module, "apply", original_apply))
        nn.Module.apply = apply
        self._patched += patch_init_functions(lambda p: ctx._filled_whole([p]))
        self._patched += patch_smart_apply(ctx._filled_whole)
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, original in reversed(self._patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched.clear()
        if self.chunk_file is not None:
            _return_freed_heap()
        error = placeholder_index_error(exc[1], self._placeholders, "the code inside engine.zero.Init") \
            if isinstance(exc[1], IndexError) else None
        if error is not None:
            self._placeholders = []
            raise error from exc[1]
        if exc[0] is None:  # an edit made in the block itself, after the model's construction
            check_no_lost_edit(((f"of shape {tuple(p.ds_shape)}", p) for p in self._placeholders),
                               "the code inside engine.zero.Init")
        self._placeholders = []


TRIM_BYTES = 64 << 20


def _return_freed_heap() -> None:
    """[Note: Init's heap] Every module's full parameters are allocated, chunked and freed in turn, and
    glibc keeps the freed blocks in its heap (its mmap threshold adapts upward after a large free;
    stage3.py's HostMemoryTrimmer note): measured on a 210M-parameter GPT, 2 ranks, the RSS after
    `Init` was 780 MiB above its start with every chunk already in its file, 25 MiB after one
    `malloc_trim(0)`. With remote_device "nvme" the point is that the model is not in host memory, so
    the heap is handed back whenever TRIM_BYTES of parameters were freed (built, or gathered by
    `Module.apply`), and at the end. Nothing to
    do without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _require_states_here(params) -> None:
    """Before any gather: an error naming reload_states while engine.offload_states() has moved the
    master partition the gathers read, or the parameters' own storage (a persistent one is read as it
    is); every rank offloads together, so every rank raises (torch's 'setStorage ... out of bounds'
    otherwise, or a gather of freed bytes)."""
    from ..offload_states import OffloadStateTypeEnum
    for zopt in {id(z): z for z in (getattr(p, "_z3_owner", None) for p in params) if z is not None}.values():
        away = getattr(zopt, "offloaded_states", None)
        if away is not None:
            away.require("GatheredParameters", (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_params),
                         owner="engine.zero.")


class GatheredParameters(contextlib.ContextDecorator):
    """Full parameters inside the block on every rank (a collective: call it on all ranks). With
    `modifier_rank`, that rank's values are broadcast on exit and every rank keeps its new chunk."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True,
                 comm: Communicator | None = None):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in dict.fromkeys(params or []) if hasattr(p, "ds_shape") or hasattr(p, "_z3_owner")]
        self.modifier_rank, self.enabled, self.comm = modifier_rank, enabled, comm
        self._engine_groups: list = []
        self._init_params: list = []
        self._held: list = []  # (coordinator, group) this block holds (prefetch.py's user_held)

    def _communicator(self) -> Communicator:
        if self.comm is None:
            owner = next((getattr(p, "_z3_owner", None) for p in self.params), None)
            self.comm = owner.comm if owner is not None else default_communicator()
        return self.comm

    def __enter__(self):
        if not self.enabled or not self.params:
            return self
        comm = self._communicator()
        _require_states_here(self.params)
        try:
            for p in self.params:
                zopt = getattr(p, "_z3_owner", None)
                group = zopt.coordinator.group_of.get(p) if zopt is not None else None
                if group is not None:
                    zopt.coordinator.user_held[group.gid] += 1  # held through any pass inside the block
                    self._held.append((zopt.coordinator, group))
                    self._engine_groups += zopt.coordinator.gather_now([group])
                elif _is_partitioned(p) and hasattr(p, "_z3_chunk"):
                    p.data = gather_full(comm, spec_of(full_shape(p), comm.world_size),
                                         chunk_tensor(p._z3_chunk).to(comm.device), full_shape(p))
                    self._init_params.append(p)
        except BaseException:  # a later gather failed (a read error): the block never runs, so what the
            self._let_go()  # earlier ones hold goes now, else it stayed held (gathered through every pass)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or not self.params:
            return
        comm = self._communicator()
        try:
            if self.modifier_rank is not None and exc[0] is None:
                with torch.no_grad():
                    for p in self.params:
                        comm.broadcast(p.data, src=self.modifier_rank)
                        self._store(p, comm)
        finally:  # a store that raised (a parameter replaced at a new shape) lets the block's groups go too
            self._let_go()

    def _let_go(self) -> None:
        """What the block holds goes: zero.Init's parameters back to placeholders, the engine's groups
        released where no other open block holds them."""
        for p in self._init_params:
            p.data = placeholder(full_shape(p), p.dtype, p.device)
            mark_placeholder(p)  # edits inside the block were made whole: not lost (init_edits.py)
        for coordinator, group in self._held:
            coordinator.user_held[group.gid] -= 1
        for g in self._engine_groups:
            if g.gathered and not any(c.user_held[g.gid] for c, h in self._held if h is g):
                g.release()  # gathered by this block and held by no other open one
        self._engine_groups, self._init_params, self._held = [], [], []

    @staticmethod
    def _store(p: torch.nn.Parameter, comm: Communicator) -> None:
        zopt = getattr(p, "_z3_owner", None)
        resized = tuple(p.shape) != full_shape(p)
        if zopt is not None:
            if resized:
                raise RuntimeError(replaced_error(p, "after engine.initialize partitioned it"))
            zopt.store_param(p)
        elif hasattr(p, "_z3_chunk"):
            if resized:  # stage3_params.py's note: resized in the block
                p.ds_shape = p.shape  # every rank ran the same code: the broadcast above had one shape
            chunk = padded_chunk(p.data, spec_of(full_shape(p), comm.world_size), comm.rank)
            if isinstance(p._z3_chunk, SwappedChunk) and resized:  # remote_device "nvme": a new slot
                p._z3_chunk = p._z3_chunk.file.put(chunk)
            elif isinstance(p._z3_chunk, SwappedChunk):  # back into its file
                p._z3_chunk.store(chunk)
            elif resized:
                p._z3_chunk = chunk.to(p._z3_chunk.device)
            else:
                p._z3_chunk.copy_(chunk)


_EXTERNAL = "_dstrain_external_params"


def _check_not_built(parameter: torch.nn.Parameter, what: str) -> None:
    if getattr(parameter, "_z3_owner", None) is not None:
        raise RuntimeError(f"engine.zero.{what}: the stage-3 engine is already built; dstrain decides which "
                           "module gathers which parameters in engine.initialize(), so register external "
                           "parameters before it (e.g. in the module's __init__)")


def register_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    """`module`'s forward uses `parameter`, which another module owns (a block reading another block's
    weight). At ZeRO stage 3 the engine then gathers `parameter` around `module`'s forward and backward,
    as for a weight tied across units (stage3_units.py). At stages 0-2 every parameter is whole anyway.
    Call it before `engine.initialize()`."""
    _check_not_built(parameter, "register_external_parameter")
    registered = module.__dict__.setdefault(_EXTERNAL, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    _check_not_built(parameter, "unregister_external_parameter")
    registered = module.__dict__.get(_EXTERNAL, [])
    module.__dict__[_EXTERNAL] = [p for p in registered if p is not parameter]


def external_parameters(module: nn.Module) -> list[torch.nn.Parameter]:
    return module.__dict__.get(_EXTERNAL, [])
