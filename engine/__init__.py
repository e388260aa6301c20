"""dstrain's runtime: `initialize()` turns a model and a DeepSpeed-style config into an `Engine`.

    eng, optimizer, loader, scheduler = engine.initialize(model=model, config="ds_config.json",
                                                          training_data=dataset)
    for batch in loader:
        loss = eng(batch)
        eng.backward(loss)
        eng.step()

`engine.checkpointing`: activation checkpointing (DeepSpeed's `deepspeed.checkpointing`).
Also: `init_distributed()` (env from dslaunch, torchrun, SLURM or MPI), `add_config_arguments(parser)`.
"""
from __future__ import annotations

import importlib

# Loaded on first use, so `dstrain check-config` and other tools need not import torch.
_LAZY = {"Engine": ".engine", "add_config_arguments": ".build", "initialize": ".build",
         "init_distributed": ".dist"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name == "checkpointing":  # activation checkpointing (DeepSpeed's deepspeed.checkpointing)
        return importlib.import_module(".checkpointing", __name__)
    if name in ("pipe", "topology"):  # engine.pipe.PipelineModule; engine.topology.current()
        return importlib.import_module("." + name, __name__)
    if name == "zero":  # engine.zero.Init, engine.zero.GatheredParameters (DeepSpeed's deepspeed.zero)
        return importlib.import_module(".zero", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
