"""What `configure()` set: the process-wide options `checkpoint()` reads (DeepSpeed keeps them as
module globals; here they are one `CheckpointSettings` object that `configure`/`unconfigure` replace).

[Note: who configures] DeepSpeed's engine never applies its `activation_checkpointing` section: the
user calls `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`. Here `initialize()` calls
`configure(deepspeed_config=config)` itself; a user's `configure(...)` call, before or after
`initialize`, still works, and its explicit arguments override the section (as DeepSpeed's do) until
`unconfigure()`. `reset()` is DeepSpeed's: it lets go of the contiguous buffers (for evaluation, where
forwards run without the backward that otherwise frees them) and leaves the configuration alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from schemas.features import CONTIGUOUS_KEYS, contiguous_checkpointing_problems


@dataclass(frozen=True)
class CheckpointSettings:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    mpu: Any = None  # Megatron-style: get_[tensor_]model_parallel_{group,rank,world_size}()


@dataclass
class _State:
    settings: CheckpointSettings = field(default_factory=CheckpointSettings)
    configured: bool = False
    explicit: dict = field(default_factory=dict)  # every explicit configure() argument since unconfigure()
    # profile: (checkpoint call index, "forward" | "recompute", seconds), in the order they ran
    timings: list = field(default_factory=list)
    calls: int = 0


STATE = _State()


def _section(deepspeed_config) -> Any:
    """The `activation_checkpointing` section of a `Config`, or of a config source (path, dict) loaded
    as `initialize` would load it (so its errors name their key paths)."""
    if deepspeed_config is None or hasattr(deepspeed_config, "activation_checkpointing"):
        return getattr(deepspeed_config, "activation_checkpointing", None)
    import torch.distributed as dist

    import schemas
    world = dist.get_world_size() if dist.is_initialized() else 1
    return schemas.load_config(deepspeed_config, world_size=world).activation_checkpointing


def configure(mpu_=None, deepspeed_config=None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: the config section's values, then each explicit
    argument that is not None over them."""
    section = _section(deepspeed_config)
    base = CheckpointSettings()
    if section is not None:
        base = CheckpointSettings(partition_activations=section.partition_activations,
                                  cpu_checkpointing=section.cpu_checkpointing,
                                  synchronize=section.synchronize_checkpoint_boundary, profile=section.profile,
                                  contiguous_checkpointing=section.contiguous_memory_optimization,
                                  num_checkpoints=section.number_checkpoints)
    # [Note: who configures] initialize() configures from the section too; the user's explicit
    # arguments, before or after it, keep winning over any section until unconfigure()
    explicit = {**STATE.explicit, **{k: v for k, v in dict(partition_activations=partition_activations,
                                                 cpu_checkpointing=checkpoint_in_cpu, synchronize=synchronize,
                                                 profile=profile, contiguous_checkpointing=contiguous_checkpointing,
                                                 num_checkpoints=num_checkpoints).items() if v is not None}}
    settings = replace(base, mpu=mpu_ if mpu_ is not None else STATE.settings.mpu, **explicit)
    # DeepSpeed asserts these after the overrides; here a one-line error naming both spellings
    problems = contiguous_checkpointing_problems(settings.partition_activations, settings.contiguous_checkpointing,
                                                 settings.num_checkpoints, keys=_ARGUMENT_KEYS)
    if problems:
        raise ValueError(problems[0])
    STATE.settings, STATE.explicit = settings, explicit
    STATE.configured = True


_ARGUMENT_KEYS = tuple(f"{key} (configure({arg}=))" for key, arg in zip(
    CONTIGUOUS_KEYS, ("partition_activations", "contiguous_checkpointing", "num_checkpoints")))


def is_configured() -> bool:
    return STATE.configured


def reset() -> None:
    """DeepSpeed's `reset`: let go of the contiguous_memory_optimization buffers, so that the next
    forward starts at slot 0 (call it between forwards that have no backward, e.g. in evaluation)."""
    from .contiguous import SLOTS
    SLOTS.release()


def unconfigure() -> None:
    """dstrain: forget what `configure` set (explicit arguments included) and the profile's timings."""
    reset()
    STATE.settings = CheckpointSettings()
    STATE.configured = False
    STATE.explicit.clear()
    STATE.timings.clear()
    STATE.calls = 0


def model_parallel_info() -> tuple[Any, int, int]:
    """(group, rank, world size) of the tensor-parallel group; (None, 0, 1) without an mpu."""
    mpu = STATE.settings.mpu
    if mpu is None:
        return None, 0, 1
    # DeepSpeed prefers Megatron's newer tensor-parallel names when the mpu has them
    kind = "tensor_model_parallel" if hasattr(mpu, "get_tensor_model_parallel_rank") else "model_parallel"
    return (getattr(mpu, f"get_{kind}_group")(), getattr(mpu, f"get_{kind}_rank")(),
            getattr(mpu, f"get_{kind}_world_size")())


def synchronize_boundary() -> None:
    if STATE.settings.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_summary() -> dict[int, dict[str, float]]:
    """With `profile` on: seconds per checkpoint call, {call index: {"forward": s, "recompute": s}}."""
    summary: dict[int, dict[str, float]] = {}
    for index, phase, seconds in STATE.timings:
        summary.setdefault(index, {}).setdefault(phase, 0.0)
        summary[index][phase] += seconds
    return summary
