"""`initialize()`: config + model → a ready `Engine` (DeepSpeed's `deepspeed.initialize`).

Order of construction, each step a small function: process group → config (batch arithmetic needs
the data-parallel world size) → seed → model on its device, identical on every rank → optimizer →
ZeRO optimizer of the configured stage → LR schedule → data loader → Engine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import schemas

from .comm import Communicator
from .data import DistributedDataLoader
from .dist import device, init_distributed
from .tensor_parallel import from_config as tensor_parallel
from .engine import Engine
from .precision import model_dtype, warn_if_slow_cpu_fp16
from .optimizers import resolve_optimizer, tag_muon_parameters
from .pipe.build import check_model_axis, check_pipeline_config, pipeline_groups
from .schedules import resolve_scheduler
from .zero import build_zero_optimizer
from .zero.partition import split_runs


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` flags (and the old `--deepscale*`)."""
    group = parser.add_argument_group("dstrain", "dstrain configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable dstrain (kept for DeepSpeed script compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="dstrain/DeepSpeed JSON or YAML config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args, config, config_params) -> Any:
    given = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        given.append(from_args)
    if len(given) > 1:
        raise schemas.ConfigError(["config given twice: pass either config= (or config_params=) "
                                   "or --deepspeed_config, not both"])
    if not given:
        raise schemas.ConfigError(["no config: pass config= to engine.initialize() or --deepspeed_config FILE"])
    return given[0]


def _start_process_group(distributed_port: int | None, dist_init_required: bool | None) -> None:
    """DeepSpeed's two arguments: `dist_init_required=False` means the caller already initialised
    torch.distributed (an error if not); otherwise the group is initialised here when it is not yet.
    `distributed_port` is the rendezvous port when the environment names none; a launcher's
    MASTER_PORT wins (every rank got it), and a port that cannot apply says so instead of vanishing."""
    if distributed_port is not None and (isinstance(distributed_port, bool) or not isinstance(distributed_port, int)
                                         or not 0 < distributed_port < 65536):
        raise ValueError(f"distributed_port: {distributed_port!r} is not a TCP port (1-65535)")
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("initialize(dist_init_required=False), but torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group() first, or leave dist_init_required unset")
    env_port = os.environ.get("MASTER_PORT")
    if distributed_port is not None and env_port not in (None, str(distributed_port)):
        why = "the process group is already initialized" if dist.is_initialized() else "the launcher's MASTER_PORT wins"
        warnings.warn(f"initialize(distributed_port={distributed_port}) has no effect: {why} "
                      f"(MASTER_PORT={env_port})", stacklevel=3)
    elif distributed_port is not None and not dist.is_initialized():
        os.environ["MASTER_PORT"] = str(distributed_port)
    init_distributed()


def _seed(seed: int) -> None:
    """The config's `seed` (+ rank): torch's, Python's and NumPy's global generators."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _apply_activation_checkpointing(model: torch.nn.Module, cfg) -> None:
    """The `activation_checkpointing` section takes effect from the config alone (DeepSpeed's needs a
    `deepspeed.checkpointing.configure` call): configure, then checkpoint the blocks it names."""
    from . import activation_checkpointing as ac
    ac.configure(deepspeed_config=cfg)
    section = cfg.activation_checkpointing
    if section.checkpoint_blocks or section.checkpoint_module_classes:
        ac.checkpoint_blocks(model, section)


def _param_groups(model: torch.nn.Module, model_parameters) -> list:
    if model_parameters is None:
        return [p for p in model.parameters()]
    return list(model_parameters)


BROADCAST_NUMEL = 1 << 20  # elements per broadcast of the initial weights (_broadcast_model)


def _broadcast_model(model: torch.nn.Module, comm: Communicator, skip=lambda t: False) -> None:
    """Make every rank start from rank 0's weights and buffers (but those `skip` names), one broadcast per dtype."""
    if comm.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if not skip(t):
            by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for tensors in by_dtype.values():
            # in runs of at most BROADCAST_NUMEL elements: the staging copy is bounded, not the model's size
            for run in split_runs(tensors, [t.numel() for t in tensors], BROADCAST_NUMEL):
                part = [tensors[i] for i in run]
                flat = torch.cat([t.reshape(-1) for t in part])
                comm.broadcast(flat, src=0)
                offset = 0
                for t in part:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


def _parallel_layout(model: torch.nn.Module, source, overrides) -> tuple[int, Any, int]:
    """(tensor-parallel degree, the pipeline's process groups or None, data-parallel world size).
    tensor_parallel/from_config.py's note: the degree is read first, so the model can be sharded
    before its optimizer is built; a PipelineModule brought its topology's groups (engine/pipe)."""
    degree = tensor_parallel.requested_degree(source, overrides)
    groups = pipeline_groups(model)
    if groups is not None:  # its topology's model axis: AutoTP's degree or its tensor-parallel layers'
        degree = check_model_axis(groups, degree)
    data_world = groups.topology.data if groups is not None else max(1, dist.get_world_size() // degree)
    return degree, groups, data_world


def _engine_class(model: torch.nn.Module) -> type:
    """The pipeline engine for a PipelineModule (tensor parallelism alone also has groups, not a pipeline)."""
    if pipeline_groups(model) is None:
        return Engine
    from .pipe.engine import PipelineEngine  # torch.distributed.pipelining only when a pipeline runs
    return PipelineEngine


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int | None = None, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, config_params=None,
               config_overrides: dict[str, Any] | None = None):
    """Build an `Engine` for `model` as `config` says. Returns (engine, optimizer, dataloader, scheduler),
    with None for what was not configured — the same tuple as `deepspeed.initialize`.

    `config_overrides`: dstrain's own, `{"dotted.key": value}` set in the config before it is
    validated, e.g. the values of a template's "auto" keys (`schemas.hf_auto_values` computes them
    from HF TrainingArguments as HF Trainer does)."""
    if model is None:
        raise ValueError("engine.initialize() needs model=")
    if mpu is not None:
        raise NotImplementedError("mpu= (Megatron-style model parallelism) is not built yet in dstrain")
    source = _config_source(args, config, config_params)
    _start_process_group(distributed_port, dist_init_required)
    degree, groups, data_world = _parallel_layout(model, source, config_overrides)
    cfg = schemas.load_config(source, world_size=data_world, overrides=config_overrides)
    check_pipeline_config(cfg, model)
    pipelined = groups is not None
    if groups is None:
        groups = tensor_parallel.tensor_parallel_groups(degree)  # None without tensor parallelism
    comm = Communicator(groups.data_group if groups is not None else None)
    _seed(cfg.seed + comm.rank)
    model = model.to(device=device(), dtype=model_dtype(cfg))  # fp16/bf16: low-precision weights
    warn_if_slow_cpu_fp16(cfg, device(), dist.get_rank())
    _broadcast_model(model, comm)
    if degree > 1:  # one copy of what a model group replicates (tensor_parallel/from_config.py's note)
        _broadcast_model(model, Communicator(groups.model_group), skip=tensor_parallel.is_partitioned)
    if degree > 1:
        tensor_parallel.apply_tensor_parallel(model, cfg, groups, pipelined)
    _apply_activation_checkpointing(model, cfg)
    tag_muon_parameters(model, cfg.optimizer)  # DeepSpeed's set_optimizer_flags
    params = _param_groups(model, model_parameters)
    if pipelined and not params:  # a stage of parameter-free layers (Tanh only): it steps no parameter,
        params = [{"params": []}]  # but takes part in the step's collectives as an all-frozen stage does
    if degree > 1:
        tensor_parallel.check_parameters(model, params, optimizer)
    base_optimizer = resolve_optimizer(optimizer, params, cfg.optimizer)
    zero_optimizer = build_zero_optimizer(base_optimizer, comm, cfg, model) if base_optimizer is not None else None
    if zero_optimizer is not None and degree > 1:  # one norm and one skip decision for the world
        tensor_parallel.agree_norm_over_tensor_parallel(zero_optimizer, model, groups)
    if zero_optimizer is not None and cfg.gradient_compression is not None:  # stage 0 only (schemas/checks.py)
        zero_optimizer.enable_gradient_compression(cfg.gradient_compression)
    scheduler = resolve_scheduler(lr_scheduler, base_optimizer, cfg.scheduler)
    loader = None
    if training_data is not None:
        loader = DistributedDataLoader(training_data, cfg.train_micro_batch_size_per_gpu, comm.rank,
                                       comm.world_size, cfg.seed, cfg.dataloader_drop_last, collate_fn)
    comm.stats.reset()
    eng = _engine_class(model)(model, zero_optimizer, scheduler, loader, cfg, comm)
    if degree > 1:
        eng.groups = groups  # the grid a checkpoint records (engine/checkpoint/placement.py)
    if cfg.checkpoint.auto_resume:  # a restarted job continues from <save_dir>/latest (engine/checkpoint)
        eng.checkpoint_io.auto_resume()
    if cfg.dump_state and comm.rank == 0:  # logs are shared: secrets redacted as in checkpoints
        from .checkpoint.format import redact_secrets
        shown = {"world_size": cfg.world_size, **redact_secrets(cfg.to_dict())}
        print(f"[dstrain] config: {json.dumps(shown, sort_keys=True)}", flush=True)
    return eng, eng.optimizer, loader, scheduler
