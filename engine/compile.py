"""`engine.compile()` (DeepSpeed's name): the user's module compiled in place with `torch.compile`
(`nn.Module.compile`: the module keeps its parameters, hooks and state-dict names; its calls run the
compiled forward), so the engine's forward, backward and step stay as they are.

As in DeepSpeed: a second call does nothing, `backend` wins over a "backend" in `compile_kwargs`, and
`is_compiled` says whether it ran. The default backend is the accelerator's (DeepSpeed's
`get_compile_backend()`): "inductor", which needs a C compiler on CPU; "eager" and "aot_eager" need none.
DeepCompile (the `compile` config section) is not built; `schedule` and `compiled_autograd_enabled` are
its arguments and are refused when given.
At ZeRO-3 the gather/release hooks around each submodule are graph breaks: dynamo compiles the code
between them and the hooks run eagerly, as uncompiled (the same result, bit for bit, in the tests);
stage 3's speed gain is therefore smaller. A pipeline engine never calls the module's forward (torch's
schedule calls its stage chunks), so there compile would do nothing: an error.
"""
from __future__ import annotations

import warnings


def compile_problem(eng) -> str | None:
    """Why this engine's module cannot be compiled, or None."""
    if getattr(eng, "stage_id", None) is not None:  # PipelineEngine: torch's schedule calls the chunks
        return ("engine.compile() is not built for a PipelineModule: the pipeline schedule runs its stage "
                "chunks, not the module's forward; compile the layers themselves (torch.compile each "
                "LayerSpec's module) instead")
    return None


def compile_module(eng, backend, compile_kwargs: dict | None, schedule, compiled_autograd_enabled: bool) -> None:
    if eng.is_compiled:
        return
    if schedule is not None or compiled_autograd_enabled:
        raise ValueError("engine.compile(): schedule= and compiled_autograd_enabled= belong to DeepSpeed's "
                         "DeepCompile, which dstrain does not build; leave them out")
    problem = compile_problem(eng)
    if problem:
        raise RuntimeError(problem)
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        warnings.warn("engine.compile(): the \"backend\" in compile_kwargs is overridden by backend=", stacklevel=3)
    kwargs["backend"] = backend
    eng.module.compile(**kwargs)  # the first forward compiles (torch.compile is lazy)
    eng._compiled = True
