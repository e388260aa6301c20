"""The README's demo works end to end: every sample config is valid, and the demo trains through
dslaunch on two ranks, saves a checkpoint, and resumes from it by itself."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import schemas
from tests.harness import free_port

REPO = Path(__file__).resolve().parent.parent
SAMPLES = sorted((REPO / "sample_configs").glob("*.json"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_config_is_valid(path):
    cfg = schemas.load_config(str(path), world_size=2)
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * 2


def _demo(tmp_path, config: str, steps: int) -> subprocess.CompletedProcess:
    # A free rendezvous port: dslaunch's default 29500 may be held by another job on the machine.
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--num_gpus", "2", "--master_port", str(free_port()),
                           "examples/train_gpt.py",
                           "--deepspeed_config", str(tmp_path / config), "--steps", str(steps),
                           "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_demo_trains_saves_and_resumes(tmp_path):
    # resume.json with its paths moved into tmp_path: periodic async saves, auto_resume.
    text = (REPO / "sample_configs" / "resume.json").read_text().replace("runs/resume", str(tmp_path / "ckpt"))
    (tmp_path / "resume.json").write_text(text)
    first = _demo(tmp_path, "resume.json", 20)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = re.search(r"demo done: 20 steps on 2 rank\(s\), loss ([\d.]+) -> ([\d.]+)", first.stdout)
    assert summary and float(summary.group(2)) < float(summary.group(1)) - 1.0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step20"
    again = _demo(tmp_path, "resume.json", 30)  # a second launch continues from step 20
    assert again.returncode == 0, again.stderr[-3000:]
    assert "demo done: 30 steps" in again.stdout
    assert "step 30 |" in again.stdout and "step 10 |" not in again.stdout  # only steps 21-30 ran
