"""`schemas.hf_auto_values` fills a template's "auto" keys as HF Trainer does, and refuses a written
value that disagrees with the arguments; the example trains a transformers GPT-2 through that path."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas import ConfigAutoWarning, ConfigError, hf_auto_values, load_config

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "ds_config_hf_zero2.json"


def training_args(**changes) -> SimpleNamespace:
    """The TrainingArguments fields the mapping reads (their HF defaults where not set here)."""
    fields = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=5e-4,
                  adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.01, max_grad_norm=0.5,
                  fp16=False, fp16_full_eval=False, bf16=True, bf16_full_eval=False, warmup_steps=0,
                  warmup_ratio=0.1, world_size=1)
    return SimpleNamespace(**{**fields, **changes})


def test_every_auto_of_the_hf_template_is_filled_as_hf_trainer_fills_it():
    fills = hf_auto_values(TEMPLATE, training_args(), SimpleNamespace(hidden_size=64), num_training_steps=95,
                           world_size=2)
    assert fills == {"fp16.enabled": False, "bf16.enabled": True, "optimizer.params.lr": 5e-4,
                     "optimizer.params.betas": [0.9, 0.98], "optimizer.params.eps": 1e-6,
                     "optimizer.params.weight_decay": 0.01, "scheduler.params.warmup_min_lr": 0,
                     "scheduler.params.warmup_max_lr": 5e-4, "scheduler.params.warmup_num_steps": 10,
                     "zero_optimization.reduce_bucket_size": 64 * 64, "gradient_accumulation_steps": 2,
                     "gradient_clipping": 0.5, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}
    config = load_config(TEMPLATE, world_size=2, overrides=fills)
    assert (config.train_batch_size, config.bf16.enabled, config.optimizer.params.betas) == (16, True, (0.9, 0.98))
    assert config.scheduler.params.warmup_num_steps == 10 and config.zero_optimization.reduce_bucket_size == 4096


def test_without_the_model_or_step_count_those_autos_stay_and_are_named():
    fills = hf_auto_values(TEMPLATE, training_args())
    assert "scheduler.params.warmup_num_steps" not in fills and "zero_optimization.reduce_bucket_size" not in fills
    with pytest.raises(ConfigError) as caught, pytest.warns(ConfigAutoWarning, match="reduce_bucket_size"):
        load_config(TEMPLATE, overrides=fills)
    assert [line.split(":")[0] for line in caught.value.problems] == ["scheduler.params.warmup_num_steps"]


def test_a_written_value_that_disagrees_with_the_arguments_is_an_error():
    raw = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.98]}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5}}}
    with pytest.raises(ConfigError) as caught:
        hf_auto_values(raw, training_args())
    assert caught.value.problems == [
        "train_micro_batch_size_per_gpu: the config says 8 but the arguments' per_device_train_batch_size is 4; "
        "make them agree or write \"auto\"",
        "optimizer.params.lr: the config says 0.001 but the arguments' learning_rate is 0.0005; make them agree "
        "or write \"auto\""]


def test_the_example_trains_a_transformers_gpt2_from_the_unchanged_template():
    before = TEMPLATE.read_bytes()
    result = subprocess.run([sys.executable, "examples/train_hf_gpt2.py", "--steps", "6", "--gas", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = re.search(r"steps (\d+)  loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert summary and int(summary.group(1)) == 6, result.stdout
    assert float(summary.group(3)) < float(summary.group(2))  # random init: ln 256 ≈ 5.5, learning from there
    assert "optimizer.params.lr=0.001" in result.stdout and "zero stage 2" in result.stdout
    assert TEMPLATE.read_bytes() == before
