"""Rules that relate several keys, checked on a config whose sections each validated on their own.

Each rule is a small function returning problem lines; `CROSS_FIELD_RULES` lists them in the order
their lines are reported.
"""
from __future__ import annotations

from typing import Callable, Optional

from schemas.config import Config
from schemas.features import contiguous_checkpointing_problems
from schemas.optimizer import ONEBIT_OPTIMIZERS, ZERO_TESTED_TYPES
from schemas.optimizer_torch import TORCH_NEEDS_CLOSURE, TORCH_PER_TENSOR
from schemas.zero import OffloadOptimizerConfig, OffloadParamConfig


def _fp16_and_bf16(config: Config) -> list[str]:
    if config.fp16.enabled and config.bf16.enabled:
        return ["fp16.enabled: true together with bf16.enabled: true; enable at most one of them"]
    return []


def _min_loss_scale(config: Config) -> list[str]:
    fp16 = config.fp16
    initial = 2.0 ** fp16.initial_scale_power
    if fp16.dynamic and fp16.min_loss_scale > initial:
        return [f"fp16.min_loss_scale: {fp16.min_loss_scale:g} is above the initial dynamic loss scale "
                f"2**fp16.initial_scale_power = {initial:g}; lower it or raise initial_scale_power"]
    return []


def _untested_zero_optimizer(config: Config) -> list[str]:
    """ZeRO's tested optimizers, as engine/optimizers.py's ZERO_SUPPORTED_OPTIMIZERS checks for an
    optimizer object; here for the one the config names, so check-config says it too."""
    stage = config.zero_optimization.stage
    kind = config.optimizer.type if config.optimizer is not None else None
    has_own_rule = (*ONEBIT_OPTIMIZERS, *TORCH_PER_TENSOR, *TORCH_NEEDS_CLOSURE)  # refused with their reason
    if stage == 0 or kind in (None, *ZERO_TESTED_TYPES, *has_own_rule) or config.zero_allow_untested_optimizer:
        return []
    return [f"optimizer.type: {kind} at zero_optimization.stage {stage}, which ZeRO has not been tested with "
            f"(tested: {', '.join(ZERO_TESTED_TYPES)}); set \"zero_allow_untested_optimizer\": true to use it anyway"]


def _whole_tensor_types(config: Config) -> list[str]:
    """torch.optim classes that need whole tensors (schemas/optimizer_torch.py's note) or a closure."""
    stage = config.zero_optimization.stage
    kind = config.optimizer.type if config.optimizer is not None else None
    if kind in TORCH_NEEDS_CLOSURE:
        return [f"optimizer.type: {kind} is not supported through the config: {TORCH_NEEDS_CLOSURE[kind]}"]
    if kind in TORCH_PER_TENSOR and stage > 0:
        return [f"optimizer.type: {kind} cannot run at zero_optimization.stage {stage}: {TORCH_PER_TENSOR[kind]}, "
                "and ZeRO hands the optimizer dim-0 chunks of each tensor; use zero_optimization.stage 0"]
    return []


def _nvme_path(name: str, section: Optional[OffloadParamConfig | OffloadOptimizerConfig]) -> list[str]:
    if section is not None and section.device == "nvme" and not section.nvme_path:
        return [f"zero_optimization.{name}.nvme_path: required when zero_optimization.{name}.device is \"nvme\""]
    return []


def _offload(config: Config) -> list[str]:
    zero = config.zero_optimization
    problems = _nvme_path("offload_param", zero.offload_param) + _nvme_path("offload_optimizer", zero.offload_optimizer)
    if zero.offload_param is not None and zero.offload_param.device != "none" and zero.stage < 3:
        problems.append(f"zero_optimization.offload_param.device: \"{zero.offload_param.device}\" needs "
                        f"zero_optimization.stage 3 (stage is {zero.stage}); parameters are only partitioned at stage 3")
    optimizer = zero.offload_optimizer
    if optimizer is not None and optimizer.ratio < 1.0 and zero.stage < 3:
        problems.append(f"zero_optimization.offload_optimizer.ratio: {optimizer.ratio:g} (partial offload) needs "
                        f"zero_optimization.stage 3 (stage is {zero.stage})")
    if optimizer is not None and optimizer.device != "none" and zero.stage == 0:
        problems.append(f"zero_optimization.offload_optimizer.device: \"{optimizer.device}\" needs "
                        f"zero_optimization.stage 1, 2 or 3 (stage is 0)")
    return problems


def _checkpoint(config: Config) -> list[str]:
    checkpoint = config.checkpoint
    problems = []
    if checkpoint.save_interval > 0 and not checkpoint.save_dir:
        problems.append(f"checkpoint.save_interval: {checkpoint.save_interval} needs checkpoint.save_dir")
    if checkpoint.auto_resume and not checkpoint.save_dir:
        problems.append("checkpoint.auto_resume: true needs checkpoint.save_dir")
    return problems


def _amp_with_mixed_precision(config: Config) -> list[str]:
    if config.amp.enabled and (config.fp16.enabled or config.bf16.enabled):
        return ["amp.enabled: true cannot be combined with fp16.enabled or bf16.enabled"]
    return []


def _compression_needs_stage0(config: Config) -> list[str]:
    """1-bit optimizers average full momenta and PowerSGD full gradients: both need every rank to hold
    the whole optimizer state, i.e. ZeRO stage 0 (DeepSpeed rejects 1-bit optimizers under ZeRO too).
    LAMB's trust ratio is per tensor even under ZeRO (engine/zero/per_tensor.py)."""
    stage, problems = config.zero_optimization.stage, []
    kind = config.optimizer.type if config.optimizer is not None else None
    if kind in ONEBIT_OPTIMIZERS and stage > 0:
        problems.append(f"optimizer.type: {kind} needs zero_optimization.stage 0 (stage is {stage}): it averages "
                        "whole momenta across ranks, which ZeRO partitions; use stage 0 or an Adam-type optimizer")
    if config.gradient_compression is not None and stage > 0:
        problems.append(f"gradient_compression: PowerSGD needs zero_optimization.stage 0 (stage is {stage}); "
                        "remove the section or use stage 0")
    if config.gradient_compression is not None and kind in ONEBIT_OPTIMIZERS:
        problems.append(f"gradient_compression: cannot be combined with optimizer.type {kind}, which compresses "
                        "its own communication; remove one of them")
    return problems


def _contiguous_checkpointing(config: Config) -> list[str]:
    section = config.activation_checkpointing
    return contiguous_checkpointing_problems(section.partition_activations, section.contiguous_memory_optimization,
                                             section.number_checkpoints)


CROSS_FIELD_RULES: tuple[Callable[[Config], list[str]], ...] = (
    _fp16_and_bf16,
    _min_loss_scale,
    _untested_zero_optimizer,
    _whole_tensor_types,
    _offload,
    _checkpoint,
    _amp_with_mixed_precision,
    _compression_needs_stage0,
    _contiguous_checkpointing,
)


def cross_field_problems(config: Config) -> list[str]:
    """Every cross-field rule's problem lines, in rule order."""
    return [line for rule in CROSS_FIELD_RULES for line in rule(config)]
