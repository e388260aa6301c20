"""Bad configs: every one is rejected with one line per problem, each naming its key path.

Each file in `tests/bad_configs/` states what it expects in comment lines at its top
(`// expect: <fragment>` in JSON, `# expect: <fragment>` in YAML; optionally `world_size: N`). Every
fragment must appear in the problem lines of the `ConfigError` it raises.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from schemas import ConfigError, load_config
from schemas.unbuilt import NOT_BUILT_SECTIONS

REPO = Path(__file__).resolve().parents[1]
BAD_CONFIGS = sorted(p for p in (REPO / "tests" / "bad_configs").iterdir() if p.suffix in (".json", ".yaml", ".yml"))
HEADER = re.compile(r"^\s*(?://|#)\s*(expect|world_size):\s?(.*)$")


def read_expectations(path: Path) -> tuple[list[str], int]:
    """The `expect` fragments and the world size stated in a bad config's header comments."""
    fragments, world_size = [], 1
    for line in path.read_text(encoding="utf-8").splitlines():
        match = HEADER.match(line)
        if match and match.group(1) == "expect":
            fragments.append(match.group(2).rstrip())
        elif match:
            world_size = int(match.group(2))
    return fragments, world_size


def test_corpus_is_large_enough():
    assert len(BAD_CONFIGS) >= 45


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=lambda p: p.name)
def test_bad_config_is_rejected_with_its_message(path: Path):
    fragments, world_size = read_expectations(path)
    assert fragments, f"{path.name} states no '// expect:' line"
    with pytest.raises(ConfigError) as caught:
        load_config(path, world_size=world_size)
    problems = caught.value.problems
    for fragment in fragments:
        assert any(fragment in line for line in problems), f"{fragment!r} not in {problems}"
    for line in problems:
        assert "\n" not in line and "pydantic" not in line and "Input should be" not in line, line


def test_config_error_is_a_value_error_naming_the_file():
    path = REPO / "tests" / "bad_configs" / "typo_zero.json"
    with pytest.raises(ValueError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: zero_optimization.reduce_bucket_sise")


def test_every_problem_is_collected_in_one_error():
    raw = {
        "train_micro_batch_size_per_gpu": 0,
        "zero_optimization": {"stage": "1", "offload_param": {"nvme_pth": "/x"}},
        "fp16": {"hysteresis": 0}, "steps_per_prnt": 10,
    }
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    text = "\n".join(caught.value.problems)
    for path in ("train_micro_batch_size_per_gpu", "zero_optimization.stage",
                 "zero_optimization.offload_param.nvme_pth", "fp16.hysteresis", "steps_per_prnt"):
        assert path in text
    assert "did you mean 'nvme_path'?" in text and "did you mean 'steps_per_print'?" in text
    assert len(caught.value.problems) == 5


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    with pytest.raises(ConfigError) as caught:
        load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"xyz": 1}})
    assert caught.value.problems == [
        "bf16.xyz: unknown key (value 1); valid keys here: bf16_master_weights_and_grads, "
        "bf16_optimizer_states, check_grad_overflow, enabled, immediate_grad_update"]


def test_unreadable_sources_are_clear_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read a config from int"):
        load_config(42)
    with pytest.raises(ConfigError, match="world_size: 0 is not valid"):
        load_config({"train_batch_size": 8}, world_size=0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_rejects_a_bad_config_without_a_traceback():
    result = run_cli("check-config", str(REPO / "tests" / "bad_configs" / "typo_wandb_and_batch.yaml"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.splitlines()
    assert all(line.startswith("error: ") for line in lines[:-1]) and len(lines) == 4
    assert lines[-1].endswith("3 problems found")


def test_cli_prints_the_resolved_config(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 32, // global\n "gradient_accumulation_steps": 2,\n'
                    ' "zero_optimization": {"cpu_offload": false}}')
    result = run_cli("check-config", str(path), "--world-size", "4")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert (resolved["world_size"], resolved["train_micro_batch_size_per_gpu"]) == (4, 4)
    assert resolved["gradient_clipping"] == 1.0
    assert "warning: config key 'zero_optimization.cpu_offload' is deprecated" in result.stderr


@pytest.mark.parametrize("name", ["batch_not_divisible_micro.json", "duplicate_nested.yaml", "invalid_json.json"])
def test_cli_in_process_exit_code_and_lines(name: str, capsys: pytest.CaptureFixture):
    assert cli_main(["check-config", str(REPO / "tests" / "bad_configs" / name), "--world-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and "Traceback" not in captured.err


def test_cli_usage_errors_exit_non_zero(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as caught:
        cli_main(["check-config", "x.json", "--world-size", "0"])
    assert caught.value.code == 2
    assert cli_main([]) == 2


def test_every_deepspeed_section_without_a_schema_is_not_built_not_unknown():
    for key in NOT_BUILT_SECTIONS:
        with pytest.raises(ConfigError) as caught:
            load_config({"train_micro_batch_size_per_gpu": 1, key: {"enabled": True}})
        assert caught.value.problems == [f"{key}: DeepSpeed's {NOT_BUILT_SECTIONS[key]} is not built yet in "
                                         "dstrain; remove the key or set \"enabled\": false"]
    # A section that only says it is off asks for nothing.
    load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"enabled": False},
                 "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"}})


def test_schema_errors_do_not_hide_not_built_and_cross_field_errors():
    with pytest.raises(ConfigError) as caught:
        load_config({"train_micro_batch_size_per_gpu": 1, "stray_key": 1, "fp16": {"enabled": True, "hysteresis": 0},
                     "bf16": {"enabled": True},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True},
                                           "mics_shard_size": 4},
                     "optimizer": {"type": "Adamm"}, "checkpoint": {"save_interval": 10}})
    heads = sorted(line.split(":")[0] for line in caught.value.problems)
    assert heads == ["checkpoint.save_interval", "fp16.enabled", "fp16.hysteresis", "optimizer.type", "stray_key",
                     "zero_optimization.mics_shard_size", "zero_optimization.offload_optimizer.super_offload"]


def test_comment_keys_are_accepted_at_any_depth_and_other_underscores_are_not():
    config = load_config({"_comment": "ZeRO-2 template", "train_micro_batch_size_per_gpu": 1,
                          "zero_optimization": {"stage": 2, "_comment_buckets": "tuned on 8 GPUs"},
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "_comment": "peak lr"}}})
    assert config.zero_optimization.stage == 2 and "_comment" not in config.to_dict()
    with pytest.raises(ConfigError, match="_note: unknown key"):
        load_config({"train_micro_batch_size_per_gpu": 1, "_note": "x"})


def test_integral_floats_pass_for_every_int_field_and_fractions_do_not():
    config = load_config({"train_batch_size": 8.0, "steps_per_print": 1e5, "seed": 42.0,
                          "fp16": {"loss_scale_window": 1e3},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e2}},
                          "optimizer": {"type": "AdamW", "params": {"lr": 1}}})
    assert (config.train_batch_size, config.steps_per_print, config.seed) == (8, 100_000, 42)
    assert type(config.steps_per_print) is int and config.fp16.loss_scale_window == 1000
    assert config.scheduler.params.warmup_num_steps == 100
    with pytest.raises(ConfigError, match="steps_per_print: 10.5 is not valid"):
        load_config({"train_batch_size": 8, "steps_per_print": 10.5})


@pytest.mark.parametrize("zero", [
    {"stage": 2, "round_robin_gradients": True},             # LLaMA-Factory's ZeRO-2 template
    {"stage": 3, "contiguous_gradients": False},             # DeepSpeed's own ZeRO-3 template
    {"stage": 1, "contiguous_gradients": False, "use_multi_rank_bucket_allreduce": False},
    {"stage": 3, "memory_efficient_linear": False, "elastic_checkpoint": True},
])
def test_settings_met_by_construction_are_accepted(zero):
    assert load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}).zero_optimization.stage == zero["stage"]


def test_an_untested_zero_optimizer_is_named_by_the_config_check():
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match="optimizer.type: SGD at zero_optimization.stage 2, which ZeRO has not"):
        load_config(raw)
    assert load_config({**raw, "zero_allow_untested_optimizer": True}).optimizer.type == "SGD"


def test_cli_set_fills_auto_values_and_names_the_unfilled_ones():
    template = str(REPO / "tests" / "agreement_configs" / "hf_template_unfilled.json")
    result = run_cli("check-config", template)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    named = [line.split(": ")[2] for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert named == ["gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                     "train_batch_size", "train_micro_batch_size_per_gpu"]
    assert "warning: zero_optimization.reduce_bucket_size: \"auto\" not filled" in result.stderr
    result = run_cli("check-config", template, "--set", "train_micro_batch_size_per_gpu=4", "--set",
                     "gradient_accumulation_steps=1", "--set",
                     "gradient_clipping=1.0", "--set", "optimizer.params.lr=3e-4", "--set",
                     "optimizer.params.weight_decay=0.0", "--world-size", "2")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert (resolved["train_batch_size"], resolved["optimizer"]["params"]["lr"]) == (8, 3e-4)


def test_cli_set_needs_key_equals_value(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as caught:
        cli_main(["check-config", "x.json", "--set", "optimizer.params.lr"])
    assert caught.value.code == 2 and "expected KEY=VALUE" in capsys.readouterr().err


def test_a_key_rejected_twice_does_not_hide_the_rest_of_its_section():
    # `stages` fails both branches of its union (int, "auto"): two errors, one key.
    with pytest.raises(ConfigError) as caught:
        load_config({"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": "x", "seed_layers": True}})
    heads = [line.split(":")[0] for line in caught.value.problems]
    assert heads == ["pipeline.stages", "pipeline.seed_layers"], caught.value.problems


def test_check_config_prints_no_secret(tmp_path, capsys):
    """The resolved config it prints (and `dump_state`'s) redacts credentials, as checkpoints do."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "comet": {"api_key": "sekrit-4242", "project": "p"}}))
    assert cli_main(["check-config", str(path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "sekrit-4242" not in out and json.loads(out)["comet"]["api_key"] == "<redacted>"
