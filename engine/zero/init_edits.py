"""In-place edits of parameters that `zero.Init` has already partitioned.

[Note: edits after partition] Init partitions a module's own parameters when that module's `__init__`
returns. A parent's `__init__` that then re-initialises a child's weight in place — nanoGPT's
`torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))` over `self.named_parameters()` — acts on
the empty placeholder, and the weight keeps the child's own initialisation. DeepSpeed's zero.Init
behaves so, silently: the model then differs from the one the user wrote. Here:
- inside Init, `torch.nn.init`'s in-place functions given a partitioned parameter gather it, run on the
  full tensor and keep rank 0's result, as the wrapped `Module.apply` does. Every rank builds the same
  model, so every rank makes the same calls (the gather is a collective). Every rank draws the same
  amount of randomness, so the model, and the random state after it, equal a model built normally
  from the same seed.
- the same functions imported by name into a module (`from torch.nn.init import constant_`: torch's own
  `nn.MultiheadAttention` zeroes its child `out_proj.bias` so, after out_proj was partitioned) are
  wrapped there too, for the block's duration.
- any other in-place change of a placeholder (`p.normal_()`, `p.mul_(...)`, an init function kept under
  another name) is found by the parameter's version counter, which every in-place op bumps and a
  `p.data = ...` assignment does not. The module whose `__init__` made it raises, naming the parameter
  and the fix. A change made through `p.data` bumps no counter and cannot be seen (docs/zero3.md).
- a module's `reset_parameters()` called after the module was partitioned (a parent re-initialising a
  child: `self.emb.reset_parameters()`) runs with the module's partitioned parameters gathered, rank 0's
  result kept. torch's `nn.Embedding` zeroes its padding row there by indexing the weight
  (`self.weight[self.padding_idx].fill_(0)`), which on the placeholder's 0 rows was an IndexError; its
  `normal_` alone would have been filled whole by the wrappers above.
- any other indexing of a placeholder (`m.weight.data[m.padding_idx].zero_()` in a parent's `__init__`,
  outside `apply`) fails in torch with "out of bounds for dimension 0 with size 0"; that IndexError is
  re-raised naming zero.Init and the ways to make the edit.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn as nn

# torch.nn.init's functions that fill their tensor argument in place
INPLACE_INIT = ("constant_", "dirac_", "eye_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_",
                "orthogonal_", "sparse_", "trunc_normal_", "uniform_", "xavier_normal_", "xavier_uniform_",
                "zeros_")


def mark_placeholder(p: torch.Tensor) -> None:
    """`p` now holds its placeholder: the version any later in-place change would move on from."""
    p._z3_version = p._version


def _edited(p: torch.Tensor) -> bool:
    """A placeholder changed in place, while no engine owns it (an engine's own writes, e.g. the broadcast
    that syncs a model at initialize, touch an empty tensor and are not edits)."""
    return (hasattr(p, "_z3_version") and p._version != p._z3_version and p.numel() == 0
            and not hasattr(p, "_z3_owner"))


def check_no_lost_edit(named_params, where: str) -> None:
    """Raise if one of the (name, parameter) pairs is a placeholder changed in place (module note)."""
    for name, p in named_params:
        if _edited(p):
            raise RuntimeError(
                f"engine.zero.Init: {where} changed parameter {name} in place after zero.Init had "
                "partitioned it: the change reached an empty placeholder and would be lost. Initialise it "
                "with a torch.nn.init function, in self.apply(fn), or inside "
                "engine.zero.GatheredParameters(param, modifier_rank=0)")


def _partitioned(p: torch.Tensor) -> bool:
    """A parameter zero.Init partitioned, holding its placeholder now (not inside a gather)."""
    return hasattr(p, "_z3_chunk") and p.numel() == 0


def wrap_reset_parameters(cls: type, filled_whole) -> list[tuple[object, str, object]]:
    """Run `cls.reset_parameters` (if `cls` defines it) with the module's partitioned parameters, its
    children's included, filled whole inside `filled_whole(params)` (module note). A call where none is
    partitioned (the module's own `__init__`, or inside a gather already) runs as it is."""
    original = cls.__dict__.get("reset_parameters")
    if not callable(original) or getattr(original, "_z3_wrapped", False):
        return []

    @functools.wraps(original)
    def reset_parameters(module, *args, **kwargs):
        params = [p for p in module.parameters() if _partitioned(p)]
        if not params:
            return original(module, *args, **kwargs)
        with filled_whole(params):
            return original(module, *args, **kwargs)
    reset_parameters._z3_wrapped = True
    setattr(cls, "reset_parameters", reset_parameters)
    return [(cls, "reset_parameters", original)]


def placeholder_index_error(error: IndexError, params, where: str) -> RuntimeError | None:
    """The error to raise instead of torch's IndexError when `where` indexed a partitioned parameter's
    placeholder (module note), or None when `error` is not that."""
    if "with size 0" not in str(error) or not any(_partitioned(p) for p in params):
        return None
    return RuntimeError(
        f"engine.zero.Init: {where} indexed a parameter that zero.Init had partitioned ({error}): between uses "
        "its data is an empty placeholder. Make the change in the module's reset_parameters(), in self.apply(fn), "
        "or inside engine.zero.GatheredParameters(param, modifier_rank=0)")


def patch_init_functions(gathered) -> list[tuple[object, str, object]]:
    """Wrap torch.nn.init's in-place functions so that a partitioned parameter is filled whole inside
    `gathered(param)` (module note). Returns (object, name, original) for each, to restore."""
    patched, importers = [], _importers()
    for name in INPLACE_INIT:
        original = getattr(nn.init, name)
        if getattr(original, "_z3_wrapped", False):  # a nested Init: the outer one's wrapper stands
            continue

        @functools.wraps(original)
        def wrapper(tensor, *args, _original=original, **kwargs):
            if not (hasattr(tensor, "_z3_chunk") and tensor.numel() == 0):
                return _original(tensor, *args, **kwargs)
            with gathered(tensor):
                _original(tensor, *args, **kwargs)
            return tensor
        wrapper._z3_wrapped = True
        for holder in [nn.init] + importers.get(name, []):
            patched.append((holder, name, original))
            setattr(holder, name, wrapper)
    return patched


def _importers() -> dict[str, list]:
    """INPLACE_INIT name -> the loaded modules other than torch.nn.init that hold torch's function under
    that name (imported by name), from one pass over sys.modules."""
    functions = {name: getattr(nn.init, name) for name in INPLACE_INIT}
    found: dict[str, list] = {}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if module is nn.init or not isinstance(namespace, dict):
            continue
        for name, function in functions.items():
            if namespace.get(name) is function:
                found.setdefault(name, []).append(module)
    return found


def _pretrained_model_class():
    """transformers' PreTrainedModel if transformers is loaded (a model of it is being built), else None."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None)


def patch_smart_apply(filled_whole) -> list[tuple[object, str, object]]:
    """Define `nn.Module.smart_apply` as transformers' walk with gathered parameters (module note)."""
    def smart_apply(module: nn.Module, fn, *args):  # transformers 5 passes is_custom_code, 4.5x nothing
        sub_model = _pretrained_model_class()
        children = list(module.children())
        for child in children:
            own = sub_model is not None and isinstance(child, sub_model)
            smart_apply(child, child._initialize_weights if own else fn, *args)
        params = list(module.parameters(recurse=False))
        for child in children:
            if sub_model is None or not isinstance(child, sub_model):
                params += child.parameters(recurse=False)
        with filled_whole(list(dict.fromkeys(params))):
            fn(module, *args)
        return module
    original = nn.Module.__dict__.get("smart_apply")
    nn.Module.smart_apply = smart_apply
    return [(nn.Module, "smart_apply", original)]
