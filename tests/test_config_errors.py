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
