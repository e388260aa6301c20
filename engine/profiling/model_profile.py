"""`get_model_profile`: DeepSpeed's stand-alone profiler call (`deepspeed.profiling.flops_profiler`),
same signature and return values: `(flops, macs, params)` of one forward pass, as numbers or, with
`as_string=True`, as text ('1.23 GFLOPS'-style). MACs are FLOPs / 2: every op torch's counter
counts is a multiply-accumulate."""
from __future__ import annotations

import os

import torch

from .module_profile import ModuleProfile
from .report import duration, profile_text, si


def _inputs(model: torch.nn.Module, input_shape, args, kwargs):
    if input_shape is None:
        return list(args or []), dict(kwargs or {})
    if args or kwargs:
        raise ValueError("get_model_profile: give input_shape or args/kwargs, not both")
    p = next(model.parameters())
    # As DeepSpeed: one tensor of the model's dtype, on the model's device, filled with ones.
    return [torch.ones(tuple(input_shape), dtype=p.dtype, device=p.device)], {}


def get_model_profile(model: torch.nn.Module, input_shape=None, args=None, kwargs=None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file: str | None = None, ignore_modules=None,
                      mode: str = "forward"):
    """Profile one forward pass of `model` (after `warm_up` unprofiled ones); returns (flops, macs, params).
    `ignore_modules`: module types that are not profiled themselves, as DeepSpeed's (ModuleProfile's `ignore`)."""
    ignore = tuple(ignore_modules or ())
    bad = [t for t in ignore if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if bad:
        raise TypeError(f"get_model_profile(ignore_modules=...): {bad} are not torch.nn.Module types; "
                        "pass the classes, e.g. ignore_modules=[torch.nn.Embedding]")
    call_args, call_kwargs = _inputs(model, input_shape, args, kwargs)
    run = getattr(model, mode) if mode != "forward" else model
    with torch.no_grad():
        for _ in range(warm_up):
            run(*call_args, **call_kwargs)
        with ModuleProfile(model, ignore) as prof:
            run(*call_args, **call_kwargs)
    flops, params = prof.total_flops, prof.total_params
    if print_profile:
        latency = prof.forward_latency_s
        summary = [("params", si(params)), ("fwd FLOPs", si(flops)), ("fwd MACs", si(flops / 2)),
                   ("fwd latency", duration(latency)),
                   ("fwd FLOPS", si(flops / latency if latency > 0 else 0.0, "FLOPS"))]
        write_profile(profile_text(prof, summary, module_depth, top_modules, detailed), output_file)
    if as_string:
        return si(flops, "FLOPS"), si(flops / 2, "MACs"), si(params)
    return flops, flops // 2, params


def output_file_problem(output_file: str | None) -> str | None:
    """Why the profile could not be written to `output_file`, checked at initialize: written at the
    profile step, a bad path failed inside `step()` after the optimizer had stepped."""
    if output_file is None:
        return None
    key, unset = f"flops_profiler.output_file: {output_file!r}", "(or leave output_file unset to print the profile)"
    parent = os.path.dirname(os.path.abspath(output_file))
    if os.path.isdir(output_file):
        return f"{key} is a directory: name a file in it {unset}"
    if not os.path.isdir(parent):
        return f"{key} is in a directory that does not exist: create {parent} {unset}"
    if not os.access(parent, os.W_OK):
        return f"{key} is in a directory this process cannot write: choose another {unset}"
    return None


def write_profile(text: str, output_file: str | None) -> None:
    if output_file is None:
        print(text, flush=True)
        return
    with open(output_file, "w") as f:
        f.write(text + "\n")
