"""The header every benchmark report starts with (command, versions, machine, load) and its tables,
shared by benchmarks/suite.py and benchmarks/gpu/run.py so their reports read the same."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_line() -> str:
    mem = psutil.virtual_memory().total / 2**30
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
            f"{mem:.0f} GiB RAM{gpu}, {platform.system()} {platform.release()}")


def header_lines(title: str, command: str, load_before: tuple, load_after: tuple, versions: dict[str, str],
                 notes: list[str] = ()) -> list[str]:
    shown = {"python": platform.python_version(), "torch": torch.__version__, "dstrain": git_commit(), **versions}
    return [f"# {title}", "",
            f"- command: `{command}`",
            f"- versions: " + ", ".join(f"{k} {v}" for k, v in shown.items()),
            f"- machine: {machine_line()}",
            f"- load average (1, 5, 15 min) before: {_load(load_before)}; after: {_load(load_after)}",
            *[f"- {n}" for n in notes], ""]


# Cells both reports write the same way (tests/test_bench_suite.py and tests/test_gpu_script.py parse them).
LOADED = " †"


def step_cells(median_ms: float, low_ms: float, high_ms: float, count: int, unit: str, loaded: bool) -> tuple[str, str]:
    """("12.3 †", "11.9–13.0 (3 round(s))"): the median, marked when measured under load, and its spread."""
    return f"{median_ms:.1f}{LOADED if loaded else ''}", f"{low_ms:.1f}–{high_ms:.1f} ({count} {unit}(s))"


def ratio_cell(ms: float | None, peer_ms: float | None, peer_error: str | None = None) -> str:
    if ms is None:
        return "not run"
    if peer_ms is None:
        return f"not run: {peer_error or 'the peer did not run'}"
    return f"{ms / peer_ms:.2f}"


def load_note(threshold: float, marked: int, total: int) -> str:
    return (f"† marks a figure with a round whose 1-minute load before it was above {threshold:g} "
            f"({marked} of {total} measurements)")


def _load(values: tuple) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def md_table(header: tuple, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command as typed from the repository root (no machine-specific paths)."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        rel = script.relative_to(ROOT)
        script_part = ["-m", ".".join(rel.with_suffix("").parts)] if rel.parts[0] == "benchmarks" else [str(rel)]
    else:
        script_part = [sys.argv[0]]
    return " ".join(["python", *script_part, *sys.argv[1:]])
