"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: DeepSpeed's way of writing a model as a list of
layers that a pipeline splits into stages (`deepspeed.pipe`).

A rank builds only the layers of its own stage(s): a `LayerSpec` is the class and arguments of a
layer, built lazily, so the full model never exists in one process. Layers are registered under
their global index (`"3.weight"`), tied layers under `tied_modules.<key>`, so parameter names do not
depend on the stage count (checkpoints reshard across pipeline sizes by name).
With `virtual_stages=V` the list is split into `num_stages × V` chunks and rank p holds chunks
p, p + P, … (the looped placement of interleaved 1F1B and interleaved zero-bubble schedules).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn

from .. import dist as dsdist
from ..comm import Communicator
from ..topology import ProcessGroups, Topology, set_current
from .partition import balanced_bounds, layer_weights


class LayerSpec:
    """A layer to be built later: `LayerSpec(nn.Linear, 512, 512)` builds `nn.Linear(512, 512)`."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by name (`key`) between stages, e.g. the token embedding and the LM head. Every
    stage holding one builds it; their weights start equal and their gradients are summed over the
    stages that hold it (the engine's tie groups), so they stay equal. `forward_fn(module, x)`, when
    given, replaces `module(x)` (the LM head as `x @ embedding.weight.T`)."""

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _param_count(layer) -> int:
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if isinstance(layer, LayerSpec):  # counted on the meta device: no memory, no RNG draw
        with torch.device("meta"):
            return sum(p.numel() for p in layer.build().parameters() if p.requires_grad)
    return 0


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule(layers, num_stages, topology, loss_fn, partition_method, ...)`.

    `topology`: an `engine.topology.Topology`, or None for `num_stages` stages with the data axis
    filling the rest of the world. Collective: every rank constructs it (it creates the process
    groups, `engine.topology.current()` afterwards). `virtual_stages`: chunks per rank (module
    docstring), needed by `pipeline.schedule` "interleaved_1f1b" and "zero_bubble".
    `activation_checkpoint_interval=N`: every N layers run under `engine.checkpointing` (its
    non-reentrant form, which the zero-bubble schedules' split backward needs).
    """

    def __init__(self, layers: list, num_stages: int | None = None, topology: Topology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: list[str] | None = None, virtual_stages: int = 1):
        super().__init__()
        if getattr(type(self).__init__, "_z3_wrapped", False):  # inside engine.zero.Init (it wraps every __init__)
            raise ValueError("PipelineModule inside engine.zero.Init is not supported: each stage builds other layers, "
                             "and Init broadcasts every layer over its whole group as it is built; build the "
                             "PipelineModule outside zero.Init (zero_optimization.stage 3 partitions each stage at "
                             "initialize)")
        dsdist.init_distributed()
        world = torch.distributed.get_world_size()
        if topology is None:
            if num_stages is None:
                raise ValueError("PipelineModule needs num_stages= or topology=")
            topology = Topology.for_world(world, pipe=num_stages)
        elif num_stages is not None and num_stages != topology.pipe:
            raise ValueError(f"PipelineModule: num_stages={num_stages} but topology has pipe={topology.pipe}")
        if virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages={virtual_stages}; use 1 or more")
        self.process_groups = ProcessGroups(topology)
        set_current(self.process_groups)
        self.topology = topology
        self.num_stages = topology.pipe
        self.virtual_stages = virtual_stages
        self.stage_id = self.process_groups.coord.pipe
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = checkpointable_layers
        if activation_checkpoint_func is None:
            from ..activation_checkpointing import non_reentrant_checkpoint
            activation_checkpoint_func = non_reentrant_checkpoint
        self.activation_checkpoint_func = activation_checkpoint_func
        self._layer_specs = list(layers)
        chunks = self.num_stages * virtual_stages
        weights = layer_weights(self._layer_specs, partition_method, lambda i: _param_count(self._layer_specs[i]))
        self.parts = balanced_bounds(weights, chunks)
        # chunk c lives on rank c % P (looped placement); this rank's chunks in schedule order
        self.chunk_ids = [self.stage_id + k * self.num_stages for k in range(virtual_stages)]
        self.tied_modules = nn.ModuleDict()
        self.tied_specs: dict[str, TiedLayerSpec] = {}
        self._forward_funcs: dict[int, list] = {}
        self._build(seed_layers, seed_fn, base_seed)
        self.tie_groups = self._tie_groups()
        self._synchronize_tied_weights()

    def _tie_groups(self) -> dict:
        """Key → this rank's tie group, for keys held by several stages (collective: every rank, key order)."""
        found = {}
        for key, stages in self.tie_stages().items():
            if len(stages) > 1:
                group = self.process_groups.tie_group(stages)
                if key in self.tied_specs:
                    found[key] = group
                    self._warn_untied(key, stages)
        return found

    def _warn_untied(self, key: str, stages: list[int]) -> None:
        """A tied module's trainable parameters outside `tied_weight_attr` are one copy per stage, each
        trained on its stage's gradient alone (as in DeepSpeed, whose default ties "weight" only): not
        the one shared module a single process would train. Said once, by the first holder's first rank."""
        spec, coord = self.tied_specs[key], self.process_groups.coord
        untied = [n for n, p in self.tied_modules[key].named_parameters()
                  if p.requires_grad and n not in spec.tied_weight_attr]
        if untied and coord.pipe == stages[0] and coord.data == 0 and coord.model == 0:
            warnings.warn(f"TiedLayerSpec {key!r} on stages {stages}: {', '.join(untied)} not in tied_weight_attr "
                          f"({spec.tied_weight_attr}), so each stage trains its own copy; list them in "
                          "tied_weight_attr to share them", stacklevel=4)

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        """Every holder of a tied layer starts from the first holder's weights (before any optimizer
        copies them into master weights)."""
        for key, group in self.tie_groups.items():
            comm = Communicator(group)
            for p in self.tied_parameters()[key]:
                comm.broadcast(p.data, src=0)

    # -- building -------------------------------------------------------------------------------
    def chunk_layers(self, chunk: int) -> range:
        return range(self.parts[chunk], self.parts[chunk + 1])

    def tie_stages(self) -> dict[str, list[int]]:
        """Tied key → the pipe stages holding it (the same on every rank: computed from the specs)."""
        stages: dict[str, set[int]] = {}
        for chunk in range(len(self.parts) - 1):
            for i in self.chunk_layers(chunk):
                spec = self._layer_specs[i]
                if isinstance(spec, TiedLayerSpec):
                    stages.setdefault(spec.key, set()).add(chunk % self.num_stages)
        return {k: sorted(v) for k, v in sorted(stages.items())}

    def _build(self, seed_layers: bool, seed_fn: Callable | None, base_seed: int) -> None:
        for chunk in self.chunk_ids:
            funcs = []
            for i in self.chunk_layers(chunk):
                spec = self._layer_specs[i]
                if seed_layers:  # the same initial weights whatever the stage count (DeepSpeed's seed_layers)
                    (seed_fn or torch.manual_seed)(base_seed + i)
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in self.tied_modules:
                        self.tied_modules[spec.key] = spec.build()
                        self.tied_specs[spec.key] = spec
                    funcs.append(_TiedCall(self.tied_modules[spec.key], spec.forward_fn))
                elif isinstance(spec, LayerSpec):
                    layer = spec.build()
                    self.add_module(str(i), layer)
                    funcs.append(layer)
                elif isinstance(spec, nn.Module):
                    self.add_module(str(i), spec)
                    funcs.append(spec)
                elif callable(spec):
                    funcs.append(spec)
                else:
                    raise TypeError(f"PipelineModule layer {i}: {spec!r} is not a LayerSpec, nn.Module or callable")
            self._forward_funcs[chunk] = funcs

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        return {key: [self.tied_modules[key].get_parameter(attr) for attr in spec.tied_weight_attr]
                for key, spec in self.tied_specs.items()}

    # -- running --------------------------------------------------------------------------------
    def run_chunk(self, chunk: int, x):
        """Apply chunk `chunk`'s layers to `x` (each layer gets the previous one's output, as DeepSpeed)."""
        funcs = self._forward_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if not interval or not torch.is_grad_enabled():
            for f in funcs:
                x = f(x)
            return x
        for start in range(0, len(funcs), interval):
            segment = funcs[start:start + interval]
            if not any(self._checkpointable(f) for f in segment):
                for f in segment:
                    x = f(x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            x = self.activation_checkpoint_func(_Segment(segment, isinstance(x, tuple)), *args)
        return x

    def _checkpointable(self, f) -> bool:
        """A layer with parameters, of a class `checkpointable_layers` names (all classes when None)."""
        if not (isinstance(f, nn.Module) and any(True for _ in f.parameters())):
            return False
        return self.checkpointable_layers is None or type(f).__name__ in self.checkpointable_layers

    def forward(self, x):
        """Run every chunk of this rank in order: only meaningful for a single-stage pipeline."""
        if self.num_stages * self.virtual_stages != 1:
            raise RuntimeError("a PipelineModule with several stages runs through engine.train_batch() / "
                               "eval_batch(), not by calling it")
        return self.run_chunk(0, x)


class _TiedCall:
    def __init__(self, module: nn.Module, forward_fn: Callable | None):
        self.module, self.forward_fn = module, forward_fn

    def __call__(self, x):
        return self.forward_fn(self.module, x) if self.forward_fn is not None else self.module(x)


class _Segment:
    """A run of layers called as one function of positional tensors (for activation checkpointing)."""

    def __init__(self, funcs: list, tupled: bool):
        self.funcs, self.tupled = funcs, tupled

    def __call__(self, *args):
        x = args if self.tupled else args[0]
        for f in self.funcs:
            x = f(x)
        return x
