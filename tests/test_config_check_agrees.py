"""`dstrain check-config` and `engine.initialize` agree: a config one accepts the other accepts, and a
config one refuses the other refuses with the same problem lines. The set: every bad config, every
sample config, and `tests/agreement_configs/` (valid DeepSpeed settings from public templates and
refusals that used to come only from initialize), so every check of either side is exercised."""
from __future__ import annotations

from pathlib import Path

import pytest

import engine
import schemas
from engine.cli import main as cli_main
from tests.harness import run_distributed
from tests.models import OddMLP

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p) for folder in ("tests/bad_configs", "sample_configs", "tests/agreement_configs")
                 for p in (REPO / folder).iterdir() if p.suffix in (".json", ".yaml", ".yml"))
MUST_PASS = ["llamafactory_zero2.json", "deepspeed_zero3_template.json", "sgd_zero1_allowed.json",
             "warmup_cosine_stage0.json"]


def _initialize_each(paths: list[str]) -> dict[str, list[str] | None]:
    """None where initialize built an engine, else its problem lines."""
    outcome = {}
    for path in paths:
        try:
            engine.initialize(model=OddMLP(), config=path)
            outcome[path] = None
        except schemas.ConfigError as err:
            outcome[path] = err.problems
    return outcome


@pytest.fixture(scope="module")
def initialized() -> dict:
    return run_distributed(_initialize_each, 1, args=(CONFIGS,), timeout=300)[0]


def _check_config(path: str, capsys) -> list[str] | None:
    code = cli_main(["check-config", path])
    err = capsys.readouterr().err
    if code == 0:
        return None
    lines = [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")]
    return [line.removeprefix(f"{path}: ") for line in lines]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{Path(p).parent.name}/{Path(p).name}")
def test_check_config_and_initialize_agree(path: str, initialized: dict, capsys):
    # Three lines of initialize's are allowed differences, because this test initializes one process
    # and check-config sees no model: sample_configs/tp2.json needs 2 processes per model copy, a
    # pipeline config needs a PipelineModule (its stages, and a schedule other than 1F1B:
    # sample_configs/pipe2_zb_h1.json), and checkpoint_blocks (sample_configs/long_sequence.json)
    # a model with blocks, which the test's OddMLP has not.
    allowed = ("autotp_size: 2 does not divide the world size 1", "needs the model to be an engine.pipe.PipelineModule",
               "needs an engine.pipe.PipelineModule", "activation_checkpointing.checkpoint_blocks: the model has no")
    problems = [p for p in initialized[path] or [] if not any(a in p for a in allowed)]
    assert _check_config(path, capsys) == (problems or None if initialized[path] is not None else None)


def test_valid_deepspeed_templates_pass_and_every_agreement_refusal_is_refused(initialized: dict):
    folder = REPO / "tests" / "agreement_configs"
    for path in sorted(folder.iterdir()):
        accepted = initialized[str(path)] is None
        assert accepted is (path.name in MUST_PASS), (path.name, initialized[str(path)])
