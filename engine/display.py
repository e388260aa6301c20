"""How a run looks: a progress bar with ETA and live loss and tokens/s, and a final summary table,
printed by global rank 0 only (the other ranks print nothing, so the output does not grow with the
world size; `dslaunch --enable_each_rank_log DIR` keeps every rank's own output in files).

On a terminal the bar is live (rich); when stdout is not a terminal (CI logs, `| tee`, a launcher's
pipe) there is no bar: at most `PLAIN_LINES` plain lines over the run, so a log stays readable.
"""
from __future__ import annotations

import sys
import time

PLAIN_LINES = 10


class TrainingProgress:
    """`update(step, loss, tokens_per_s)` after each optimizer step; `close()` at the end."""

    def __init__(self, total_steps: int, rank: int, start_step: int = 0, live: bool | None = None):
        self.total, self.enabled = total_steps, rank == 0
        self.live = self.enabled and (sys.stdout.isatty() if live is None else live)
        self._start_step, self._t0 = start_step, time.perf_counter()
        self._every = max(1, (total_steps - start_step) // PLAIN_LINES)
        self._bar, self._last = None, start_step
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._bar = Progress(TextColumn("[bold cyan]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[stats]}"))
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, stats="")
            self._bar.start()

    def eta_s(self, step: int) -> float:
        done = step - self._start_step
        return (time.perf_counter() - self._t0) / done * (self.total - step) if done > 0 else float("nan")

    def update(self, step: int, loss: float | None, tokens_per_s: float | None) -> None:
        """Call after every micro-step; acts once per optimizer step."""
        if not self.enabled or step == self._last:
            return
        self._last = step
        stats = ", ".join(s for s in (f"loss {loss:.4f}" if loss is not None else "",
                                     f"{tokens_per_s:,.0f} tok/s" if tokens_per_s else "") if s)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
        elif (step - self._start_step) % self._every == 0 or step == self.total:
            eta = self.eta_s(step)
            eta_text = f"ETA {eta:.0f}s" if eta == eta else "ETA -"
            print(f"[dstrain] progress {step}/{self.total} | {stats} | {eta_text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def print_summary(title: str, rows: list[tuple[str, str]], files: list[str], rank: int) -> None:
    """A two-column table of the run's figures, then the files it wrote (rank 0 only)."""
    if rank != 0:
        return
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    for path in files:
        table.add_row("wrote", path)
    Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120).print(table)
