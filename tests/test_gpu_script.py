"""benchmarks/gpu/run.py's `--cpu` mode: the GPU script's checks, on CPU with gloo, so it cannot rot
between the runs on a GPU machine (issue 15), its offload checks included (issue 17:
benchmarks/gpu/offload_checks.py) and its long-sequence checks (issue 19: sparse attention and activation
checkpointing, benchmarks/gpu/long_sequence_checks.py, one rank only); and its report in the suite's
format (benchmarks/report.py: the same header, cells that are a figure or say why not, ratios that
follow from the step times)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.report_format import is_figure_or_reason, missing_header_lines, ratio_matches, tables

ROOT = Path(__file__).resolve().parent.parent
# Offload cases (issue 17): optimizer offload at stages 1-3, parameter offload (with the optimizer's) at 3.
OFFLOAD_CHECKS = [f"offload {tiers} ZeRO-{stage} {precision}"
                  for tiers, stages in (("optimizer cpu", (1, 2, 3)), ("optimizer nvme", (1, 2, 3)),
                                        ("parameters+optimizer cpu", (3,)), ("parameters+optimizer nvme", (3,)),
                                        ("parameters nvme+optimizer cpu", (3,)),
                                        ("frozen blocks, parameters+optimizer nvme", (3,)))
                  for stage in stages for precision in ("fp32", "bf16")]
# Long sequences (issue 19), on one rank: two layouts in fp32 and bf16, three checkpointing sections in fp32.
LONG_SEQUENCE_CHECKS = ([f"sparse attention {layout} {precision}"
                         for layout in ("Fixed, key padding + causal", "BigBird") for precision in ("fp32", "bf16")]
                        + [f"activation checkpointing {section} fp32"
                           for section in ("full", "selective_unpack", "full + cpu_checkpointing")])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("gpu")
    out = tmp / "report.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=tmp)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out.read_text()


def test_gpu_script_cpu_mode_passes_its_checks(report):
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    checks = [r for r in rows if "| PASS |" in r or "| FAIL |" in r]
    # 12 stage x precision cases, 6 resumes, zero.Init, 20 offload cases: on one rank and again on two;
    # the long-sequence cases on one rank only.
    assert len(checks) == 2 * (19 + len(OFFLOAD_CHECKS)) + len(LONG_SEQUENCE_CHECKS), report
    assert all("| PASS |" in r for r in checks), report
    assert any("ZeRO-3 fp16" in r for r in checks) and any("2 ranks: resume ZeRO-3 async save" in r for r in checks)
    detail = {r.split(" | ")[0].removeprefix("| "): r.split(" | ")[2] for r in checks}
    for name in OFFLOAD_CHECKS:
        for row in (name, f"2 ranks: {name}"):
            assert detail[row].startswith("fp32 masters equal to"), (row, detail.get(row))
            # where the check found the offloaded state: a host flat and optimizer state, or swap buffers
            assert ("swap_buffers" if "nvme" in name else "optimizer_state") in detail[row], (row, detail[row])
    for name in LONG_SEQUENCE_CHECKS:  # what each compared: the masked dense reference, or no checkpointing
        want = "largest difference: output" if "sparse" in name else "equal to the model without checkpointing"
        assert want in detail[name] and f"2 ranks: {name}" not in detail, (name, detail.get(name))
    assert "rows with nothing to attend to: zeros" in detail["sparse attention Fixed, key padding + causal bf16"]


def test_gpu_report_is_in_the_suite_format(report):
    from benchmarks.gpu.run import SYSTEMS, THROUGHPUT_HEADER, TORCH_SYSTEM
    assert missing_header_lines(report) == [], report
    _, throughput = tables(report)
    header, *rows = throughput
    assert header == [*THROUGHPUT_HEADER[:-1], "peak RSS GiB"]
    assert [r[1] for r in rows] == list(SYSTEMS)
    for row in rows:
        assert len(row) == len(header) and all(c and is_figure_or_reason(c) for c in row[2:]), row
        assert not row[2].startswith("not run"), row  # on CPU every system runs the tiny GPT
    ms = {r[1]: float(r[2].split()[0]) for r in rows}
    # the suite's ZeRO-formula column: on one rank every system holds all 16 bytes per parameter
    # (fp32 4 + 4 + 8 for autocast and FSDP2; bf16 2 + 2 and 12 of fp32 master weights and moments)
    from benchmarks.gpu.run import TINY, _n_params
    assert {r[7] for r in rows} == {f"{16 * _n_params(TINY) / 2**30:.3g}"}, rows
    for row in rows:
        assert ratio_matches(row[4], ms[row[1]], ms[TORCH_SYSTEM]), row
        low, high = (float(v) for v in row[3].split()[0].split("–"))
        assert low <= ms[row[1]] <= high and row[3].endswith("(2 step(s))"), row  # 4 steps, 2 warm-up
