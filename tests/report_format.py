"""What a benchmark report (benchmarks/report.py: the suite's and the GPU script's) looks like, for the
tests that read one: its header lines and its tables, every cell a figure or the reason there is none."""
from __future__ import annotations

import re

HEADER_PATTERNS = (r"- command: `python ",
                   r"- versions: python [\d.]+, torch [\w.+]+, dstrain \w+",
                   r"- machine: \S+",
                   r"- load average \(1, 5, 15 min\) before: [\d.]+, [\d.]+, [\d.]+; after: [\d.]+, [\d.]+, [\d.]+",
                   r"† marks a figure with a round whose 1-minute load before it was above [\d.]+ \(\d+ of \d+ "
                   r"measurements\)")
_FIGURE = re.compile(r"[\d.,]+( †)?|[\d.]+–[\d.]+ \(\d+ (round|step)\(s\)\)|[\d.]+ MiB|[\d.]+%")
_REASON = ("not run", "n/a: ", "not counted: ")


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table as rows of stripped cells (the header first, the --- rule left out)."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            found.append([row for row in current if not set("".join(row)) <= {"-"}])
            current = []
    return found


def is_figure_or_reason(cell: str) -> bool:
    return bool(_FIGURE.fullmatch(cell)) or cell.startswith(_REASON)


def missing_header_lines(text: str) -> list[str]:
    return [p for p in HEADER_PATTERNS if not re.search(p, text)]


def ratio_matches(cell: str, ms: float, peer_ms: float) -> bool:
    """A ratio cell (2 decimals) against the step times as shown (1 decimal, so each ±0.05 ms)."""
    rel = 0.05 / ms + 0.05 / peer_ms
    return abs(float(cell) - ms / peer_ms) <= 0.005 + rel * ms / peer_ms
