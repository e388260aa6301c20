"""The config language: DeepSpeed 0.19.8 defaults, every way of loading, deprecated keys, "auto",
and the batch-size derivation table (reference §1.2)."""
from __future__ import annotations

import base64
import json
import sys
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from schemas import Config, ConfigAutoWarning, ConfigDeprecationWarning, ConfigError, load_config
from schemas.checkpoint import CheckpointConfig
from schemas.deprecated import map_deprecated_keys
from schemas.errors import _models_in
from schemas.zero import ZeroConfig

MINIMAL = {"train_micro_batch_size_per_gpu": 2}

# (attribute path, DeepSpeed 0.19.8 code default)
DEEPSPEED_DEFAULTS = [
    ("gradient_clipping", 1.0), ("steps_per_print", None), ("wall_clock_breakdown", False),
    ("dump_state", False), ("memory_breakdown", False), ("prescale_gradients", False),
    ("gradient_predivide_factor", 1.0), ("communication_data_type", None), ("sparse_gradients", False),
    ("zero_allow_untested_optimizer", False), ("zero_force_ds_cpu_optimizer", True),
    ("disable_allgather", False), ("dataloader_drop_last", False), ("seed", 1234), ("amp.enabled", False),
    ("optimizer", None), ("scheduler", None),
    ("fp16.enabled", False), ("fp16.auto_cast", False), ("fp16.loss_scale", 0.0),
    ("fp16.initial_scale_power", 16), ("fp16.loss_scale_window", 1000), ("fp16.hysteresis", 2),
    ("fp16.consecutive_hysteresis", False), ("fp16.min_loss_scale", 1.0),
    ("fp16.fp16_master_weights_and_grads", False),
    ("bf16.enabled", False), ("bf16.immediate_grad_update", False), ("bf16.check_grad_overflow", True),
    ("data_types.grad_accum_dtype", None),
    ("zero_optimization.stage", 0), ("zero_optimization.contiguous_gradients", True),
    ("zero_optimization.reduce_scatter", True), ("zero_optimization.reduce_bucket_size", 500_000_000),
    ("zero_optimization.use_multi_rank_bucket_allreduce", True),
    ("zero_optimization.allgather_partitions", True), ("zero_optimization.allgather_bucket_size", 500_000_000),
    ("zero_optimization.overlap_comm", False), ("zero_optimization.load_from_fp32_weights", True),
    ("zero_optimization.elastic_checkpoint", False), ("zero_optimization.offload_param", None),
    ("zero_optimization.offload_optimizer", None), ("zero_optimization.sub_group_size", 1_000_000_000),
    ("zero_optimization.prefetch_bucket_size", 50_000_000),
    ("zero_optimization.param_persistence_threshold", 100_000),
    ("zero_optimization.model_persistence_threshold", sys.maxsize),
    ("zero_optimization.max_live_parameters", 1_000_000_000),
    ("zero_optimization.max_reuse_distance", 1_000_000_000),
    ("zero_optimization.gather_16bit_weights_on_model_save", False),
    ("zero_optimization.module_granularity_threshold", 0),
    ("zero_optimization.use_all_reduce_for_fetch_params", False),
    ("zero_optimization.ignore_unused_parameters", True), ("zero_optimization.legacy_stage1", False),
    ("zero_optimization.round_robin_gradients", False), ("zero_optimization.zero_hpz_partition_size", 1),
    ("zero_optimization.zero_quantized_weights", False), ("zero_optimization.zero_quantized_gradients", False),
    ("zero_optimization.mics_shard_size", -1), ("zero_optimization.memory_efficient_linear", True),
    ("aio.block_size", 1_048_576), ("aio.queue_depth", 8), ("aio.intra_op_parallelism", 1),
    ("aio.single_submit", False), ("aio.overlap_events", True), ("aio.use_gds", False),
    ("activation_checkpointing.partition_activations", False),
    ("activation_checkpointing.cpu_checkpointing", False),
    ("activation_checkpointing.contiguous_memory_optimization", False),
    ("activation_checkpointing.number_checkpoints", None),
    ("activation_checkpointing.synchronize_checkpoint_boundary", False), ("activation_checkpointing.profile", False),
    ("sparse_attention", None), ("checkpoint.tag_validation", "Warn"), ("checkpoint.load_universal", False),
    ("checkpoint.use_node_local_storage", False), ("checkpoint.parallel_write.pipeline_stage", False),
    ("pipeline.stages", "auto"), ("pipeline.partition", "best"), ("pipeline.seed_layers", False),
    ("pipeline.activation_checkpoint_interval", 0), ("pipeline.pipe_partitioned", True),
    ("pipeline.grad_partitioned", True),
    ("tensorboard.enabled", False), ("tensorboard.output_path", ""), ("tensorboard.job_name", "DeepSpeedJobName"),
    ("csv_monitor.enabled", False), ("wandb.enabled", False), ("wandb.project", "deepspeed"),
    ("comet.enabled", False), ("comms_logger.enabled", False), ("comms_logger.prof_all", True),
    ("flops_profiler.enabled", False), ("flops_profiler.profile_step", 1), ("flops_profiler.module_depth", -1),
    ("flops_profiler.top_modules", 1), ("flops_profiler.detailed", True), ("flops_profiler.output_file", None),
    ("elasticity.enabled", False), ("elasticity.max_train_batch_size", 2000),
    ("elasticity.micro_batch_sizes", [2, 4, 6]), ("elasticity.min_gpus", 1), ("elasticity.max_gpus", 10000),
    ("elasticity.version", 0.2), ("elasticity.prefer_large_batch", True),
    # dstrain's own keys
    ("fault_tolerance.nan_policy", "skip"), ("fault_tolerance.max_consecutive_skips", 100),
    ("checkpoint.save_dir", None), ("checkpoint.save_interval", 0), ("checkpoint.keep_last", None),
    ("checkpoint.auto_resume", False), ("checkpoint.async_save", False), ("gradient_compression", None),
]


def attribute(obj, dotted: str):
    for key in dotted.split("."):
        obj = getattr(obj, key)
    return obj


@pytest.mark.parametrize("path,expected", DEEPSPEED_DEFAULTS, ids=[p for p, _ in DEEPSPEED_DEFAULTS])
def test_defaults_are_deepspeed_0_19_8(path, expected):
    assert attribute(load_config(MINIMAL), path) == expected


def all_models(model: type[BaseModel], seen: set) -> set:
    if model not in seen:
        seen.add(model)
        for field in model.model_fields.values():
            for inner in _models_in(field.annotation):
                all_models(inner, seen)
    return seen


def test_every_field_has_a_one_line_docstring():
    for model in all_models(Config, set()):
        for name, field in model.model_fields.items():
            assert field.description and field.description.strip(), f"{model.__name__}.{name}"


def test_config_is_frozen_and_records_its_world_size():
    config = load_config({"train_batch_size": 16}, world_size=4)
    assert (config.world_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 4, 1)
    with pytest.raises(ValidationError):
        config.seed = 1
    assert load_config(config, world_size=4) is config
    resized = load_config(config, world_size=2)
    assert (resized.world_size, resized.train_micro_batch_size_per_gpu) == (2, 8)


def test_resolved_config_round_trips():
    config = load_config({"train_batch_size": 16, "bfloat16": {"enabled": True},
                          "zero_optimization": {"stage3_max_reuse_distance": 1e3},
                          "optimizer": {"type": "adam", "params": {"betas": [0.8, 0.9]}}}, world_size=2)
    again = load_config(json.loads(json.dumps(config.to_dict())), world_size=2)
    assert again.to_dict() == config.to_dict() and again.optimizer.type == "Adam"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_every_source_kind_loads_the_same_config(tmp_path: Path):
    as_dict = {"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 200_000_000},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}
    json_file = write(tmp_path / "ds.json", """// leading comment
    {
      "train_batch_size": 8, /* a "quoted" block
      comment */ "zero_optimization": {"reduce_bucket_size": 2e8},  // trailing
      "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}
    }""")
    yaml_file = write(tmp_path / "ds.yaml", """# comment
train_batch_size: 8
zero_optimization: {reduce_bucket_size: 2e8}
optimizer: {type: AdamW, params: {lr: 1.0e-3}}
""")
    encoded = base64.urlsafe_b64encode(json.dumps(as_dict).encode()).decode()
    expected = load_config(as_dict).to_dict()
    for source in (json_file, str(json_file), yaml_file, tmp_path / "ds.yaml", encoded):
        assert load_config(source).to_dict() == expected
    assert load_config(yaml_file).zero_optimization.reduce_bucket_size == 200_000_000


def test_comment_markers_inside_strings_are_kept(tmp_path: Path):
    path = write(tmp_path / "ds.json", '{"train_batch_size": 8, "tensorboard": {"job_name": "a//b/*c*/"}}')
    assert load_config(path).tensorboard.job_name == "a//b/*c*/"


def test_float_sizes_become_ints():
    config = load_config({**MINIMAL, "zero_optimization": {"allgather_bucket_size": 5e8,
                                                           "stage3_prefetch_bucket_size": 1e7}})
    assert config.zero_optimization.allgather_bucket_size == 500_000_000
    assert type(config.zero_optimization.prefetch_bucket_size) is int


def test_stage3_keys_accept_both_spellings():
    long = load_config({**MINIMAL, "zero_optimization": {"stage3_max_live_parameters": 1e6}})
    short = load_config({**MINIMAL, "zero_optimization": {"max_live_parameters": 1e6}})
    assert long.zero_optimization.max_live_parameters == short.zero_optimization.max_live_parameters == 10**6


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage, expected):
    assert ZeroConfig(stage=stage).overlap_comm is expected
    assert ZeroConfig.model_validate({"stage": stage, "overlap_comm": "auto"}).overlap_comm is expected
    assert ZeroConfig(stage=stage, overlap_comm=not expected).overlap_comm is (not expected)


def test_auto_batch_keys_are_derived_and_tunables_take_the_default_with_a_warning():
    with pytest.warns(ConfigAutoWarning, match="zero_optimization.reduce_bucket_size: \"auto\" not filled"):
        config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": 2,
                              "zero_optimization": {"reduce_bucket_size": "auto", "overlap_comm": "auto"}},
                             world_size=2)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.zero_optimization.overlap_comm is False


def test_an_auto_batch_key_only_two_given_keys_determine_is_never_defaulted():
    with pytest.raises(ConfigError) as caught:  # gradient_accumulation_steps would silently become 1
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto"}, world_size=2)
    assert [line.split(":")[0] for line in caught.value.problems] == [
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    # Absent (not "auto") keys keep DeepSpeed's derivation table.
    assert load_config({"train_batch_size": 16}, world_size=2).gradient_accumulation_steps == 1


def test_an_unfilled_auto_hyper_parameter_is_an_error_naming_each_key():
    with pytest.raises(ConfigError) as caught:
        load_config({**MINIMAL, "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})
    paths = [line.split(":")[0] for line in caught.value.problems]
    assert paths == ["gradient_clipping", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas"]
    assert all("--set" in line and "config_overrides" in line and "hf_auto_values" in line
               for line in caught.value.problems)


def test_overrides_fill_auto_keys_and_any_other_key():
    config = load_config({**MINIMAL, "gradient_clipping": "auto",
                          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                         overrides={"gradient_clipping": 0.5, "optimizer.params.lr": 3e-4, "fp16.enabled": True})
    assert (config.gradient_clipping, config.optimizer.params.lr, config.fp16.enabled) == (0.5, 3e-4, True)
    with pytest.raises(ConfigError, match="optimizer.params.lr: cannot set it, optimizer is \"x\""):
        load_config({**MINIMAL, "optimizer": "x"}, overrides={"optimizer.params.lr": 1.0})


def test_bfloat16_alias_and_tag_validation_case():
    assert load_config({**MINIMAL, "bfloat16": {"enabled": True}}).bf16.enabled
    assert CheckpointConfig(tag_validation="fail").tag_validation == "Fail"


# (given keys, world size, expected (train_batch_size, micro, gradient_accumulation_steps))
BATCH_TABLE = [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
    ({"train_batch_size": 7}, 1, (7, 7, 1)),
]


@pytest.mark.parametrize("given,world_size,expected", BATCH_TABLE)
def test_batch_derivation_table(given, world_size, expected):
    config = load_config(given, world_size=world_size)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected
    assert config.given_batch_keys == given


def load_warning_free(raw: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(raw)


@pytest.mark.parametrize("zero,path,expected", [
    ({"stage3_gather_fp16_weights_on_model_save": True}, "gather_16bit_weights_on_model_save", True),
    ({"cpu_offload": False}, "offload_optimizer", None),
    ({"cpu_offload_param": False}, "offload_param", None),
])
def test_deprecated_zero_keys_are_mapped_with_a_warning(zero, path, expected):
    with pytest.warns(ConfigDeprecationWarning, match=f"zero_optimization.{next(iter(zero))}' is deprecated"):
        config = load_config({**MINIMAL, "zero_optimization": zero})
    assert attribute(config.zero_optimization, path) == expected


def test_deprecated_offload_keys_map_to_offload_sections():
    with pytest.warns(ConfigDeprecationWarning) as caught:
        mapped, problems = map_deprecated_keys({"zero_optimization": {
            "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}})
    assert problems == [] and len(caught) == 3
    assert mapped["zero_optimization"] == {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                           "offload_param": {"device": "cpu", "pin_memory": True}}


def test_old_aio_thread_count_is_mapped_not_ignored():
    with pytest.warns(ConfigDeprecationWarning, match="aio.intra_op_parallelism"):
        assert load_config({**MINIMAL, "aio": {"thread_count": 1}}).aio.intra_op_parallelism == 1
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError, match="aio.intra_op_parallelism: 4"):
        load_config({**MINIMAL, "aio": {"thread_count": 4}})  # mapped, then rejected as not built yet


def test_boolean_zero_form_and_top_level_allgather_size():
    with pytest.warns(ConfigDeprecationWarning):
        config = load_config({**MINIMAL, "zero_optimization": False, "allgather_size": 1e8})
    assert (config.zero_optimization.stage, config.zero_optimization.allgather_bucket_size) == (0, 100_000_000)
    with pytest.warns(ConfigDeprecationWarning):  # DeepSpeed's boolean form: true means stage 1
        assert load_config({**MINIMAL, "zero_optimization": True}).zero_optimization.stage == 1


def test_a_plain_config_loads_without_warnings():
    load_warning_free({**MINIMAL, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
