"""dstrain's runtime: `initialize()` turns a model and a DeepSpeed-style config into an `Engine`.

    eng, optimizer, loader, scheduler = engine.initialize(model=model, config="ds_config.json",
                                                          training_data=dataset)
    for batch in loader:
        loss = eng(batch)
        eng.backward(loss)
        eng.step()

Also: `init_distributed()` (env from dslaunch, torchrun, SLURM or MPI), `add_config_arguments(parser)`.
"""
from .dist import init_distributed
from .engine import Engine
from .initialize import add_config_arguments, initialize

__all__ = ["Engine", "add_config_arguments", "init_distributed", "initialize"]
