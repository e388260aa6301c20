"""The benchmark suite's `--quick` mode (benchmarks/suite.py) writes a report whose every cell holds a
figure or says why not ("not run: why", "n/a: ...", "not counted: ..."), with the header a reader
needs (command, versions, machine, load), the plots, and figures that follow from their definitions:
ratios from the step times, bytes per step from the collectives each system runs, counted where they
pass: ZeRO-1's from dstrain's counter (reduce-scatter of the gradients + all-gather of the parameters:
8 bytes per fp32 parameter), DDP's from a comm hook (one all-reduce of every gradient: 4 bytes)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt import GPT, count_parameters
from tests.report_format import is_figure_or_reason, missing_header_lines, ratio_matches, tables

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("suite")
    # The smallest run that still fills every column: one torch peer, one strategy, no DeepSpeed venv.
    done = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--systems", "ddp,dstrain-z1",
                           "--worlds", "2", "--scaling-system", "dstrain-z1", "--out-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("*-quick.md")
    return out, path.read_text()


def test_every_cell_is_a_figure_or_says_why_not(report):
    _, text = report
    main, scaling = tables(text)
    header, *rows = main
    assert [r[0] for r in rows] == ["ddp", "dstrain-z1", "deepspeed (dstrain-z1's config)"]
    for row in rows + scaling[1:]:
        assert len(row) == len(header) if row in rows else len(row) == 3
        for cell in row[1:]:
            assert cell and (is_figure_or_reason(cell) or cell.startswith(("parameters (M) = ", "world size = "))), \
                (row[0], cell)
    deepspeed = rows[2]
    assert deepspeed[1] == "not run: no --deepspeed-venv given"
    assert [r[0] for r in scaling[1:]] == ["parameters (M) = 0.01", "parameters (M) = 0.02", "parameters (M) = 0.07",
                                          "world size = 2"]


def test_header_says_command_versions_machine_load_and_how_bytes_are_counted(report):
    _, text = report
    assert missing_header_lines(text) == []
    assert "- command: `python -m benchmarks.suite --quick --systems ddp,dstrain-z1" in text
    assert re.search(r"- versions: .*, deepspeed not installed", text)
    for who in ("dstrain", "dstrain-pipe2, dstrain-tp2 and dstrain-pipe2-tp2", "ddp", "fsdp2", "deepspeed"):
        assert f"- bytes/step/rank of {who}: " in text


def test_ratios_and_bytes_follow_from_their_definitions(report):
    from benchmarks.suite import QUICK_MODEL
    _, text = report
    _, ddp, z1, _ = tables(text)[0]
    step = {row[0]: float(row[1].split()[0]) for row in (ddp, z1)}
    assert ratio_matches(z1[3], step["dstrain-z1"], step["ddp"]), (z1[3], step)
    psi = count_parameters(GPT(QUICK_MODEL))
    assert float(z1[9].split()[0]) == pytest.approx(8 * psi / 2**20, rel=0.05)  # + padding and the norm's scalars
    assert float(ddp[9].split()[0]) == pytest.approx(4 * psi / 2**20, abs=0.0006)  # every gradient once
    assert float(z1[8]) == pytest.approx((8 * psi + 8 * psi / 2) / 2**20, abs=0.01)  # ZeRO-1 formula, 2 ranks


def test_plots_are_written(report):
    out, text = report
    for name in re.findall(r"!\[([^\]]+)\]", text):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert len(re.findall(r"!\[", text)) == 2
