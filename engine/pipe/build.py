"""How `initialize()` meets a `PipelineModule`: the groups come from the module (it built them), the
config is checked against it, and ZeRO-3 is refused (docs/parallelism.md says why)."""
from __future__ import annotations

import schemas

from .module import PipelineModule


def pipeline_groups(model):
    """The module's `ProcessGroups` for a PipelineModule, else None (pure data parallelism)."""
    return model.process_groups if isinstance(model, PipelineModule) else None


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
        if cfg.zero_optimization.stage == 3:
            problems.append("zero_optimization.stage: 3 with a PipelineModule is not supported: stage 3 gathers "
                            "each layer's parameters around every forward and backward, which a pipeline runs "
                            "once per micro-batch; use stage 1 or 2 (partitioned over the data axis)")
        if model.loss_fn is None:
            problems.append("PipelineModule(loss_fn=...) is needed to train: the last stage computes the loss")
    if problems:
        raise schemas.ConfigError(problems)
