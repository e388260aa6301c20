"""Checkpoint a model's blocks without editing it: what `initialize()` does with the section's
`checkpoint_blocks` / `checkpoint_module_classes` / `policy` keys (dstrain's own).

[Note: patching forward] Each chosen module's `forward` is replaced, on the instance, by one that runs
the original forward inside `non_reentrant_checkpoint`. The module stays where it was, so parameter
names, state dicts, checkpoints and ZeRO-3's units (whose hooks sit on the module's `__call__`, outside
the patched forward, and gather again before the module's backward, i.e. before the recompute) are
unchanged. The non-reentrant checkpoint takes keyword arguments and inputs that need no gradient,
which a block's forward may have; the selective policy needs it too. `policy: "selective_unpack"`
runs the original forward under saved-tensor hooks instead (`unpack_recompute.py`): no checkpoint
region; the model's own forward runs under them too (the note below).

[Note: KV caches] A HF block handed the model's KV cache (`DynamicCache`: GPT-2 passes it positionally,
Llama as `cache=`; the default `use_cache=True` makes one even in training) appends its keys and values
to it, and a recompute would append them again: attention over 2T keys, or a crash where the mask or a
selective policy's saved tensors have T. So while grad is on (a backward may replay the region) a
checkpointed block gets no cache and `use_cache=False`, as HF's own gradient checkpointing does in
training (`GradientCheckpointingLayer`); the returned cache holds nothing of these blocks. Under
`torch.no_grad()` nothing is replayed and the cache is passed as it is (generation works).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from schemas import ConfigError

from .checkpoint import non_reentrant_checkpoint
from .policy import CONTEXTS
from .unpack_recompute import recompute_on_unpack


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every ModuleList/Sequential holding two or more modules of one class."""
    blocks = []
    for container in model.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            children = list(container.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                blocks.extend(children)
    return blocks


def _is_pipeline(model: nn.Module) -> bool:
    from ..pipe.module import PipelineModule  # here: the pipe package imports this one
    return isinstance(model, PipelineModule)


def _chosen(model: nn.Module, section) -> list[nn.Module]:
    """[Note: nothing found is an error] `checkpoint_blocks` that finds no block would leave the memory
    the config asks to save unsaved, silently. A PipelineModule's layers are registered one by one, not
    as a block list, so it finds none there: said as such, on every stage alike (an error on some stages
    only would leave the others waiting in initialize's collectives). For the same reason a class named
    in `checkpoint_module_classes` may be absent from a pipeline stage: each stage holds some layers."""
    pipeline = _is_pipeline(model)
    if section.checkpoint_blocks and pipeline:
        raise ConfigError(["activation_checkpointing.checkpoint_blocks finds no block list in a PipelineModule (its "
                           "layers are the stages' own); use PipelineModule(activation_checkpoint_interval=N), or "
                           "name the block class in activation_checkpointing.checkpoint_module_classes"])
    chosen = repeated_blocks(model) if section.checkpoint_blocks else []
    if section.checkpoint_blocks and not chosen:
        raise ConfigError(["activation_checkpointing.checkpoint_blocks: the model has no nn.ModuleList or "
                           "nn.Sequential of two or more modules of one class to checkpoint; name the block classes "
                           "in activation_checkpointing.checkpoint_module_classes instead"])
    names = set(section.checkpoint_module_classes)
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - present)
    if missing and not pipeline:
        raise ValueError(f"activation_checkpointing.checkpoint_module_classes: {missing} are not classes of any "
                         f"module of the model; use class names of its modules (e.g. {sorted(present)[:5]})")
    chosen += [m for m in model.modules() if type(m).__name__ in names]
    # a module inside another chosen one is recomputed with it already
    inside = {id(d) for m in chosen for d in list(m.modules())[1:]}
    return [m for m in dict.fromkeys(chosen) if id(m) not in inside]


def checkpoint_blocks(model: nn.Module, section) -> list[nn.Module]:
    """Patch the chosen modules' forward to run checkpointed (see the module note); returns them.
    Calling it again on a patched module leaves it as it is."""
    context = CONTEXTS.get(section.policy)  # None: "full"
    if section.policy == "selective_unpack" and (section.cpu_checkpointing or section.partition_activations):
        raise ValueError("activation_checkpointing.policy: 'selective_unpack' keeps no checkpoint inputs for "
                         "cpu_checkpointing or partition_activations to move or split; use policy 'full' or "
                         "'selective' with them")
    blocks = _chosen(model, section)
    for block in blocks:
        if "forward" in vars(block):  # patched already (or by the user)
            continue
        original = block.forward

        def forward(*args, _original=original, **kwargs):
            if torch.is_grad_enabled():
                args, kwargs = _without_kv_cache(args, kwargs)
            return non_reentrant_checkpoint(_original, *args, context_fn=context, **kwargs)

        def forward_unpacked(*args, _original=original, **kwargs):
            with recompute_on_unpack():  # no checkpoint region: unpack_recompute.py
                return _original(*args, **kwargs)

        block.forward = forward_unpacked if section.policy == "selective_unpack" else forward
    if section.policy == "selective_unpack" and model not in blocks and "forward" not in vars(model):
        _unpack_outside_blocks(model)
    return blocks


def _is_kv_cache(value) -> bool:
    """A transformers `Cache` (every HF cache class derives from `cache_utils.Cache`), found by name
    so that this module does not import transformers."""
    return any(c.__name__ == "Cache" for c in type(value).__mro__)


def _without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's arguments with no KV cache and `use_cache=False` (the note on KV caches)."""
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _unpack_outside_blocks(model: nn.Module) -> None:
    """[Note: the model's own region] Under "selective_unpack" the model's forward is a region too, the
    blocks' regions nested in it (one dispatch mode for all: unpack_recompute.py), so the same rule
    covers what runs outside the blocks: a GPT's final layer norm output, which its head's matmul
    saves, is remade from that norm's input (the last block's output, held anyway). A head's logits
    are recorded too (a widening matmul) but a cross-entropy saves only their log-softmax, which no
    rule drops (it is what its backward reads): nothing of the head is recomputed."""
    original = model.forward

    def forward(*args, **kwargs):
        with recompute_on_unpack():
            return original(*args, **kwargs)

    model.forward = forward
