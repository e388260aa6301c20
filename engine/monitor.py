"""What the engine tells the user while it trains: timers and the periodic log line (rank 0 only)."""
from __future__ import annotations

import time
from collections import defaultdict

import psutil
import torch


class Timers:
    """Wall-clock timers for `wall_clock_breakdown` (forward, backward, allreduce, step), in ms.
    On a GPU the host runs ahead of the kernels, so each start and stop first waits for `device`
    (a host sync per timer: the price of the breakdown, paid only when it is on)."""

    def __init__(self, enabled: bool, device: torch.device | None = None):
        self.enabled = enabled
        self._sync = torch.cuda.synchronize if enabled and device is not None and device.type == "cuda" else None
        self._device = device
        self.total_ms: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._step_ms: dict[str, float] = defaultdict(float)  # since the last optimizer step (monitors)
        self._start: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            if self._sync is not None:
                self._sync(self._device)
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            if self._sync is not None:
                self._sync(self._device)
            elapsed = (time.perf_counter() - self._start.pop(name)) * 1e3
            self.total_ms[name] += elapsed
            self._step_ms[name] += elapsed
            self.count[name] += 1

    def means_and_reset(self) -> dict[str, float]:
        out = {k: self.total_ms[k] / max(1, self.count[k]) for k in self.total_ms}
        self.total_ms.clear()
        self.count.clear()
        return out

    def step_totals_and_reset(self) -> dict[str, float]:
        """Each timer's total over the micro-steps of the optimizer step that just ended."""
        out = dict(self._step_ms)
        self._step_ms.clear()
        return out


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


class StepLogger:
    """Prints one line every `steps_per_print` optimizer steps on rank 0 (rich markup on a terminal)."""

    def __init__(self, steps_per_print: int | None, rank: int, train_batch_size: int):
        self.every = steps_per_print
        self.enabled = bool(steps_per_print) and rank == 0
        self.train_batch_size = train_batch_size
        self._t0 = time.perf_counter()
        self._steps0 = 0
        self._console = None

    def rebase(self, global_step: int) -> None:
        """Measure the next line's rate from here: a run resumed at `global_step` ran none of the
        steps before it, so counting them over this process's time overstated samples/s."""
        self._t0, self._steps0 = time.perf_counter(), global_step

    def due(self, global_step: int) -> bool:
        return self.enabled and global_step % self.every == 0

    def log(self, global_step: int, loss: float | None, lr: list[float], skipped: int,
            breakdown: dict[str, float] | None = None, extra: str = "") -> None:
        now = time.perf_counter()
        steps = global_step - self._steps0
        sps = steps * self.train_batch_size / max(now - self._t0, 1e-9)
        self._t0, self._steps0 = now, global_step
        loss_s = f"{loss:.4f}" if loss is not None else "-"
        lr_s = ",".join(f"{x:.3e}" for x in lr)
        line = (f"step {global_step} | loss {loss_s} | lr {lr_s} | {sps:.1f} samples/s | "
                f"rss {rss_mb():.0f} MB | skipped {skipped}{extra}")
        if breakdown:
            line += " | " + " ".join(f"{k} {v:.1f}ms" for k, v in sorted(breakdown.items()))
        self._print(line)

    def _print(self, line: str) -> None:
        from rich.markup import escape
        if self._console is None:
            from rich.console import Console
            self._console = Console(highlight=False, soft_wrap=True)
        self._console.print(f"[bold cyan]\\[dstrain][/] {escape(line)}", markup=True)
