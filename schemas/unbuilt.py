"""Config keys whose feature dstrain has not built yet: rejected, never silently ignored.

[Note: one row per key] Each row of `UNBUILT` names a key path (a leaf or a whole section). A config
is rejected when the value there differs from its schema default (or, with `built`, is not one of
the values that are built), and, with `when`, only in the configs `when` picks (e.g. one ZeRO stage).
When a feature lands, delete its row and nothing else. A row on a section's `enabled` (or an offload
`device`) also stands for the section's other keys: they act only once that key is on.
`NOT_BUILT_SECTIONS` are DeepSpeed 0.19 top-level keys dstrain has no schema for yet; they are
reported as "not built yet" (a feature that exists), not as unknown keys (a typo). Optimizer and
scheduler types that are not built are rejected by `schemas/optimizer.py` / `schemas/scheduler.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from pydantic import BaseModel

from schemas.errors import show_value


@dataclass(frozen=True)
class Unbuilt:
    """A key whose non-default values are rejected; `built` (if given) says which values are fine."""

    path: str
    hint: str = ""
    built: Optional[Callable[[Any], bool]] = None
    permanent: bool = False  # never going to be built: say "not supported", not "not built yet"
    when: Optional[Callable[[Any], bool]] = None  # the configs the row applies to (all when None)
    where: str = ""  # words saying which configs `when` picks, e.g. "at zero_optimization.stage 3"


def _stage(*stages: int) -> Callable[[Any], bool]:
    return lambda config: config.zero_optimization.stage in stages


def _not_nvme_optimizer(config: Any) -> bool:
    """Configs where the NVMe optimizer tier (engine/zero/nvme_tier.py), the one reader of the swap keys, is off."""
    section = config.zero_optimization.offload_optimizer
    return not (section is not None and section.device == "nvme" and config.zero_optimization.stage in (1, 2, 3))


def _not_nvme_params(config: Any) -> bool:
    """Configs where NVMe parameter offload (engine/zero/param_nvme.py), the one reader of its keys, is off."""
    section = config.zero_optimization.offload_param
    return not (section is not None and section.device == "nvme" and config.zero_optimization.stage == 3)


_PARAM_NVME_WHERE = 'without zero_optimization.offload_param.device "nvme" at zero_optimization.stage 3'
_NVME_WHERE = 'without zero_optimization.offload_optimizer.device "nvme" at zero_optimization.stage 1, 2 or 3'


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


_ZEROPP = "ZeRO++ is not built yet; remove it"
UNBUILT: tuple[Unbuilt, ...] = (
    # Offload (README, Offload): "cpu" and "nvme" are built for both sections; the NVMe parameter keys are
    # read only by engine/zero/param_nvme.py, at stage 3 with offload_param.device "nvme".
    *(Unbuilt(f"zero_optimization.offload_param.{key}", "only NVMe parameter offload reads it; remove it",
              when=_not_nvme_params, where=_PARAM_NVME_WHERE)
      for key in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")),
    *(Unbuilt(key, "only that NVMe offload reads it; remove it", when=_not_nvme_optimizer,
              where=_NVME_WHERE) for key in (*(f"zero_optimization.offload_optimizer.{k}" for k in (
                  "nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init", "swap_slots",
                  "swap_gradients")),
                  "zero_optimization.sub_group_size")),
    Unbuilt("aio", "only NVMe offload reads it; remove it",
            when=lambda c: _not_nvme_optimizer(c) and _not_nvme_params(c),
            where=f'{_NVME_WHERE} or offload_param.device "nvme" at stage 3'),
    Unbuilt("zero_optimization.offload_optimizer.ratio", "partial offload (Twin-Flow) is not built yet; remove it "
            "or use 1.0"),
    Unbuilt("zero_optimization.offload_optimizer.super_offload", "Superchip offload is not built yet; remove it"),
    Unbuilt("zero_optimization.offload_optimizer.cpuadam_cores_perc", "it applies to super_offload, which is not "
            "built yet; remove it"),
    Unbuilt("zero_optimization.load_from_fp32_weights", "dstrain always loads the fp32 master weights; remove it",
            built=_is(True)),
    Unbuilt("zero_optimization.override_module_apply", "engine.zero.Init always gathers parameters around "
            "Module.apply; remove it", built=_is(True)),
    Unbuilt("zero_optimization.legacy_stage1", "DeepSpeed removed it too; remove it", permanent=True),
    Unbuilt("zero_optimization.mics_shard_size", "MiCS is not built yet; remove it or use -1"),
    Unbuilt("zero_optimization.mics_hierarchical_params_gather"),
    Unbuilt("zero_optimization.zero_hpz_partition_size", "ZeRO++ hpZ is not built yet; remove it or use 1",
            built=lambda v: v <= 1),
    Unbuilt("zero_optimization.zero_quantized_weights", _ZEROPP),
    Unbuilt("zero_optimization.zero_quantized_nontrainable_weights", _ZEROPP),
    Unbuilt("zero_optimization.zero_quantized_gradients", _ZEROPP),
    Unbuilt("zero_optimization.zeropp_loco_param", _ZEROPP),
    Unbuilt("zero_optimization.zenflow", "ZenFlow is not built yet; remove it"),
    Unbuilt("zero_optimization.leaf_module", "stage 3 units are chosen as docs/zero3.md says; remove it"),
    Unbuilt("optimizer.legacy_fusion", "remove it"),
    Unbuilt("zero_optimization.pipeline_loading_checkpoint"),
    Unbuilt("zero_optimization.log_trace_cache_warnings"),
    Unbuilt("zero_optimization.enable_sanity_checks"),
    Unbuilt("zero_optimization.allgather_partitions", "stage 3 always all-gathers; remove it",
            built=_is(True), when=_stage(3), where="at zero_optimization.stage 3"),
    Unbuilt("zero_optimization.contiguous_gradients", "it applies to stages 1-3 only; remove it",
            when=_stage(0), where="at zero_optimization.stage 0"),
    Unbuilt("zero_optimization.round_robin_gradients", "it applies to stages 1-3 only; remove it",
            when=_stage(0), where="at zero_optimization.stage 0"),
    Unbuilt("zero_optimization.module_granularity_threshold", "stage 3 units are chosen as docs/zero3.md says; "
            "remove it", when=_stage(3), where="at zero_optimization.stage 3"),
    Unbuilt("zero_optimization.use_all_reduce_for_fetch_params", "stage 3 fetches with all-gather; remove it",
            when=_stage(3), where="at zero_optimization.stage 3"),
    Unbuilt("zero_optimization.allgather_sequential", "stage 3 gathers each unit in one all-gather; remove it",
            when=_stage(3), where="at zero_optimization.stage 3"),
    Unbuilt("fp16.fp16_master_weights_and_grads", "master weights and gradients are fp32; remove it"),
    Unbuilt("bf16.bf16_master_weights_and_grads", "master weights and gradients are fp32; remove it"),
    Unbuilt("bf16.bf16_optimizer_states", "optimizer states are fp32; remove it"),
    Unbuilt("bf16.immediate_grad_update"),
    Unbuilt("bf16.check_grad_overflow", "dstrain always checks bf16 gradients; fault_tolerance.nan_policy "
            "says what a non-finite one does; remove it", built=_is(True)),
    Unbuilt("pipeline.partition", "pass partition_method= to engine.pipe.PipelineModule; remove it"),
    Unbuilt("pipeline.seed_layers", "pass seed_layers= to engine.pipe.PipelineModule; remove it"),
    Unbuilt("pipeline.activation_checkpoint_interval", "pass activation_checkpoint_interval= to "
            "engine.pipe.PipelineModule; remove it"),
    Unbuilt("tensor_parallel.dtype", "the model's precision comes from the fp16/bf16 sections; remove it"),
    Unbuilt("tensor_parallel.tp_overlap_comm", "remove it or use false"),
    Unbuilt("tensor_parallel.vocab_parallel_lm_head", "AutoTP keeps the LM head whole (a model can use "
            "engine.tensor_parallel.VocabParallelEmbedding and vocab_parallel_cross_entropy); remove it",
            built=lambda v: v is None or v is False),
    Unbuilt("tensor_parallel.vocab_parallel_ce_backend", 'remove it or use "torch"'),
    Unbuilt("tensor_parallel.tensor_parallel", "for training use tensor_parallel.autotp_size; remove it"),
    Unbuilt("tensor_parallel.injection_policy_tuple", "AutoTP picks projections by name (docs: README, Tensor "
            "parallelism); remove it"),
    Unbuilt("tensor_parallel.partition_config", "AutoTP picks projections by name; remove it"),
    Unbuilt("tensor_parallel.preset_model", "AutoTP picks projections by name; remove it"),
    Unbuilt("tensor_parallel.keep_module_on_host", "remove it or use false"),
    Unbuilt("tensor_parallel.replace_with_kernel_inject", "remove it or use false"),
    Unbuilt("comms_logger.enabled"),
    Unbuilt("elasticity.enabled"),
    Unbuilt("amp.enabled", "use fp16 or bf16", permanent=True),
    Unbuilt("sparse_gradients"),
    Unbuilt("memory_breakdown"),
    Unbuilt("disable_allgather", "ZeRO gathers with all-gather; remove it"),
    Unbuilt("zero_force_ds_cpu_optimizer", "offloaded state is stepped by the configured torch optimizer (its "
            "fused CPU kernel for Adam/AdamW); remove it", built=_is(True)),
    Unbuilt("checkpoint.load_universal", "dstrain checkpoints load at any world size and stage without it; "
            "loading DeepSpeed universal checkpoints is not built yet; remove it"),
    Unbuilt("checkpoint.use_node_local_storage", "use a shared file system (the default)"),
    Unbuilt("checkpoint.parallel_write"),
)

# DeepSpeed 0.19 top-level keys without a dstrain schema: key -> the feature it belongs to.
NOT_BUILT_SECTIONS: dict[str, str] = {
    "autotuning": "autotuning", "compression_training": "compression training",
    "data_efficiency": "data efficiency (data sampling and routing)",
    "curriculum_learning": "curriculum learning", "progressive_layer_drop": "progressive layer drop",
    "tp": "tensor parallelism (AutoTP)",
    "seq_parallel_communication_data_type": "sequence parallelism", "compile": "torch.compile integration",
    "managed_gradient_accumulation": "managed gradient accumulation",
    "gradient_allreduce_op": "a configurable gradient all-reduce op", "torch_autocast": "torch.autocast mixed precision",
    "graph_harvesting": "CUDA graph harvesting", "hybrid_engine": "the hybrid (RLHF) engine",
    "use_data_before_expert_parallelism": "expert parallelism (MoE)", "expert_parallel": "expert parallelism (MoE)",
    "log_level": "log levels", "nebula": "Nebula checkpointing", "datastates_ckpt": "DataStates checkpointing",
    "weight_quantization": "weight quantization", "quantize_training": "quantized training",
    "timers": "timers", "eigenvalue": "eigenvalue computation (for progressive layer drop)",
}


def _section_is_off(value: Any) -> bool:
    # A section that only says it is off asks for nothing; DeepSpeed ignores the rest of it too.
    return isinstance(value, dict) and value.get("enabled") is False


def not_built_sections(raw: dict) -> tuple[dict, list[str]]:
    """`raw` without the DeepSpeed sections dstrain has no schema for, and one line per section that asks
    for its feature (a section with "enabled": false asks for nothing and is accepted)."""
    kept, problems = {}, []
    for key, value in raw.items():
        if key not in NOT_BUILT_SECTIONS:
            kept[key] = value
        elif not _section_is_off(value):
            problems.append(f"{key}: DeepSpeed's {NOT_BUILT_SECTIONS[key]} is not built yet in dstrain; "
                            "remove the key" + (" or set \"enabled\": false" if isinstance(value, dict) else ""))
    return kept, problems


def _value_and_default(config: BaseModel, path: str) -> Optional[tuple[Any, Any]]:
    """The value at `path` and the schema default there; None when a section on the way is absent."""
    node: Any = config
    default: Any = None
    for key in path.split("."):
        if node is None:
            return None
        default = type(node).model_fields[key].get_default(call_default_factory=True)
        node = getattr(node, key)
    return node, default


def _differences(path: str, value: Any, default: Any) -> Iterator[tuple[str, Any, Any]]:
    """(path, value, default) of every leaf where `value` differs from `default`."""
    if isinstance(value, BaseModel) and type(value) is type(default):
        for key in type(value).model_fields:
            yield from _differences(f"{path}.{key}", getattr(value, key), getattr(default, key))
    elif value != default:
        yield path, value, default


def _line(row: Unbuilt, path: str, value: Any, default: Any) -> str:
    if isinstance(value, BaseModel) and default is None:
        what = "the section"
    else:
        what = show_value(value)
    status = "is not supported by dstrain" if row.permanent else "is not built yet in dstrain"
    if row.where:
        status = f"{status} {row.where}"
    hint = row.hint or (f"remove it or use the default {show_value(default)}" if default is not None
                        else "remove it")
    return f"{path}: {what} {status}; {hint}"


def unbuilt_problems(config: BaseModel) -> list[str]:
    """One line per key of `config` that asks for a feature dstrain does not have."""
    problems = []
    for row in UNBUILT:
        found = _value_and_default(config, row.path)
        if found is None or (row.when is not None and not row.when(config)):
            continue
        value, default = found
        if row.built is not None:
            if not row.built(value):
                problems.append(_line(row, row.path, value, default))
            continue
        problems.extend(_line(row, path, v, d) for path, v, d in _differences(row.path, value, default))
    return problems
