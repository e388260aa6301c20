"""benchmarks/gpu/run.py's `--cpu` mode: the GPU script's checks, on CPU with gloo, so it cannot rot
between the runs on a GPU machine (issue 15)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_script_cpu_mode_passes_and_writes_its_report(tmp_path):
    report = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--cpu", "--out", str(report)],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = report.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    checks = [r for r in rows if "| PASS |" in r or "| FAIL |" in r]
    # 12 stage x precision cases, 6 resumes, zero.Init: on one rank and again on two.
    assert len(checks) == 2 * 19 and all("| PASS |" in r for r in checks), text
    assert any("ZeRO-3 fp16" in r for r in checks) and any("2 ranks: resume ZeRO-3 async save" in r for r in checks)
    bench = [r for r in rows if r.startswith("| tiny GPT")]
    assert len(bench) == 4 and not any("FAIL" in r for r in bench), text
