"""How `initialize()` meets a `PipelineModule`: the groups come from the module (it built them), the
config is checked against it (ZeRO-3 inside a stage: zero3.py).

[Note: pipeline × tensor parallelism] The module's topology carries the model axis: its stages' layers
are either engine.tensor_parallel layers (built inside the module, over its model group) or dense
layers that AutoTP shards at initialize (`tensor_parallel.autotp_size`, which must then equal the
axis). A stage's tensor-parallel ranks start from one copy of what they replicate: initialize
broadcasts over the data group and then, skipping the shards, over the model group."""
from __future__ import annotations

import schemas

from .module import PipelineModule


def pipeline_groups(model):
    """The module's `ProcessGroups` for a PipelineModule, else None (pure data parallelism)."""
    return model.process_groups if isinstance(model, PipelineModule) else None


def check_model_axis(groups, degree: int) -> int:
    """The model axis of a PipelineModule's topology, which `tensor_parallel.autotp_size` (when > 1) must equal."""
    model = groups.topology.model
    if degree > 1 and degree != model:
        topo = groups.topology
        raise schemas.ConfigError([f"tensor_parallel.autotp_size: {degree}, but the PipelineModule's topology has "
                                   f"model={model}; build it with topology=Topology(pipe={topo.pipe}, "
                                   f"data={topo.world_size // (topo.pipe * degree)}, model={degree}) "
                                   "(engine.topology), or make the key equal to its model axis"])
    return model


def check_pipeline_config(cfg, model) -> None:
    """One line per mismatch between the config and the model, naming the key."""
    problems = []
    stages = cfg.pipeline.stages
    if not isinstance(model, PipelineModule):
        if stages not in ("auto", 1):
            problems.append(f"pipeline.stages: {stages} needs the model to be an engine.pipe.PipelineModule "
                            "(a list of layers split into stages); build one, or remove pipeline.stages")
        if cfg.pipeline.schedule != "1f1b":
            problems.append(f"pipeline.schedule: {cfg.pipeline.schedule!r} needs an engine.pipe.PipelineModule; "
                            "remove it")
    else:
        if stages != "auto" and stages != model.num_stages:
            problems.append(f"pipeline.stages: {stages}, but the PipelineModule has num_stages={model.num_stages}; "
                            'make them equal or use "auto"')
        if model.loss_fn is None:
            problems.append("PipelineModule(loss_fn=...) is needed to train: the last stage computes the loss")
    if problems:
        raise schemas.ConfigError(problems)
