"""`hf_auto_values`: the values HF Trainer writes into a template's "auto" keys, for dstrain.

    overrides = schemas.hf_auto_values("ds_config_zero2.json", training_args, model.config,
                                       num_training_steps=1000)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(),
                                config="ds_config_zero2.json", config_overrides=overrides)

The mapping is HF Transformers' (`HfTrainerDeepSpeedConfig.trainer_config_process` and
`trainer_config_finalize`, transformers 5): batch sizes, clipping, the optimizer's
lr/betas/eps/weight_decay, the WarmupLR/WarmupDecayLR params, fp16/bf16 from TrainingArguments;
bucket sizes from the model's hidden size. `training_args` is any object with TrainingArguments'
attribute names (duck-typed: no transformers import). As in HF, a key that is not "auto" but disagrees with the arguments is an
error, so the template and the arguments cannot silently say two different things.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from schemas.auto import auto_paths, is_auto
from schemas.errors import ConfigError, show_value
from schemas.loading import read_config_source


# Keys HF fills when "auto" but does not compare when written (its `fill_only`).
_FILL_ONLY = ("scheduler.params.warmup_min_lr", "zero_optimization.reduce_bucket_size",
              "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold")


def _hidden_size(model_config: Any) -> Optional[int]:
    for config in (model_config, getattr(model_config, "text_config", None)):  # multimodal: the text model's
        if getattr(config, "hidden_size", None) is not None:
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    return None


def _warmup_steps(args: Any, total: Optional[int]) -> Optional[int]:
    """TrainingArguments.get_warmup_steps(total), at least 1 (as HF fills it)."""
    if total is None:
        return None
    if hasattr(args, "get_warmup_steps"):
        return max(1, args.get_warmup_steps(total))
    steps = getattr(args, "warmup_steps", 0) or 0
    return max(1, steps if steps > 0 else math.ceil(total * (getattr(args, "warmup_ratio", 0.0) or 0.0)))


def _sources(args: Any, model_config: Any, total: Optional[int], world_size: int) -> dict[str, tuple[str, Any]]:
    """path -> (where the value comes from, the value); None values are not known here."""
    fp16 = bool(getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False))
    bf16 = bool(getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False))
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    hidden = _hidden_size(model_config)
    found = {
        "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", micro),
        "gradient_accumulation_steps": ("gradient_accumulation_steps", gas),
        "train_batch_size": ("world_size × per_device_train_batch_size × gradient_accumulation_steps",
                             world_size * micro * gas),
        "gradient_clipping": ("max_grad_norm", getattr(args, "max_grad_norm", None)),
        "optimizer.params.lr": ("learning_rate", args.learning_rate),
        "optimizer.params.betas": ("[adam_beta1, adam_beta2]", [getattr(args, "adam_beta1", 0.9),
                                                                getattr(args, "adam_beta2", 0.999)]),
        "optimizer.params.eps": ("adam_epsilon", getattr(args, "adam_epsilon", 1e-8)),
        "optimizer.params.weight_decay": ("weight_decay", getattr(args, "weight_decay", 0.0)),
        "scheduler.params.warmup_min_lr": ("0 (HF's choice)", 0),
        "scheduler.params.warmup_max_lr": ("learning_rate", args.learning_rate),
        "scheduler.params.warmup_num_steps": ("the warmup steps of num_training_steps", _warmup_steps(args, total)),
        "scheduler.params.total_num_steps": ("num_training_steps", total),
        "fp16.enabled": ("fp16 or fp16_full_eval", fp16),
        "bf16.enabled": ("bf16 or bf16_full_eval", bf16),
    }
    if hidden is not None:
        for key, value in (("reduce_bucket_size", hidden * hidden),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", 10 * hidden)):
            found[f"zero_optimization.{key}"] = ("the model's hidden_size", value)
    return found


def _value_at(raw: dict, path: str) -> Any:
    node: Any = raw
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def hf_auto_values(config: Any, training_args: Any, model_config: Any = None,
                   num_training_steps: Optional[int] = None, world_size: Optional[int] = None) -> dict[str, Any]:
    """The `config_overrides` that fill `config`'s "auto" keys as HF Trainer does.

    `config`: a dict or a config file path (left unchanged). `model_config`: the model's config
    (`hidden_size`), for the bucket-size keys. `num_training_steps`: for the scheduler's step counts.
    `world_size`: data-parallel ranks (default `training_args.world_size`, else 1). An "auto" these
    inputs cannot fill stays, so `load_config` names it. Raises `ConfigError` listing every key whose
    written value disagrees with the arguments.
    """
    raw, _ = read_config_source(config)
    world = world_size or getattr(training_args, "world_size", 1) or 1
    sources = _sources(training_args, model_config, num_training_steps, world)
    fills, mismatches = {}, []
    for path in auto_paths(raw):
        if path in sources and sources[path][1] is not None:
            fills[path] = sources[path][1]
    for path, (where, value) in sources.items():
        written = _value_at(raw, path)
        if path in _FILL_ONLY or written is None or is_auto(written) or value is None or _same(written, value):
            continue
        mismatches.append(f"{path}: the config says {show_value(written)} but the arguments' {where} is "
                          f"{show_value(value)}; make them agree or write \"auto\"")
    if mismatches:
        raise ConfigError(mismatches)
    return fills


def _same(written: Any, value: Any) -> bool:
    close: Callable[[Any, Any], bool] = lambda a, b: (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                                      and not isinstance(a, bool) and math.isclose(a, b))
    if isinstance(written, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(written) == len(value) and all(w == v or close(w, v) for w, v in zip(written, value))
    return written == value or close(written, value)
