"""The measured bubble: the wall-clock share of a pipeline step a rank spends not computing.

schedule.py's `idle_fractions` replays the executed actions on a unit-cost clock: a property of the
schedule. This is the same quantity measured: each rank times its own schedule run (the span of
torch's `_step_microbatches`) and, inside it, every computation its stages make (forward, full
backward, input- and weight-gradient halves, and the last stage's loss). What remains of the span is
time the rank was blocked in receives and waits for a peer, plus torch's scheduling work between
actions (posting the sends and receives, bookkeeping) — the bubble as a profiler would show it.

[Note: what a timer sees on an accelerator] On CPU a computation has finished when its call
returns, so host timestamps bracket it. On CUDA a call only queues kernels, so timestamps are CUDA
events recorded on the current stream around each call: a receive's `wait()` makes that stream wait
on the communication stream before the next action's start event, so the event pair spans the
computation alone. The events are read (one synchronisation) only when the fraction is asked for,
never on the step's path.
"""
from __future__ import annotations

import time

import torch


class _HostMarks:
    """Timestamps of the host clock (CPU: computations finish inside their calls)."""

    def __init__(self, timer):
        self.timer = timer

    def mark(self):
        return self.timer()

    def seconds(self, start, end) -> float:
        return end - start


class _EventMarks:
    """Timing events on the device's current stream (module note)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class StageClock:
    """One rank's step span and the computation intervals inside it (module docstring). Nested `busy`
    blocks count once (the outermost), so a loss computed inside a forward is not timed twice."""

    def __init__(self, device: torch.device, timer=None):
        if timer is not None or device.type == "cpu":
            self.marks = _HostMarks(timer or time.perf_counter)
        else:
            self.marks = _EventMarks(device)
        self._step: list = []
        self._busy: list[tuple] = []
        self._depth = 0
        self._start = None

    def start_step(self) -> None:
        self._busy.clear()
        self._step = [self.marks.mark()]

    def stop_step(self) -> None:
        self._step.append(self.marks.mark())

    def busy(self) -> "StageClock":
        """`with clock.busy():` around a computation (a plain __enter__/__exit__: it runs several times
        per micro-batch, where a generator-based context manager costs more than the timestamps)."""
        return self

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._start = self.marks.mark()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self._busy.append((self._start, self.marks.mark()))
        return False

    def intervals(self) -> int:
        """How many computations the last step timed."""
        return len(self._busy)

    def idle_fraction(self) -> float:
        """1 − (time computing) / (the step's span) of the last step."""
        if len(self._step) != 2:
            raise RuntimeError("StageClock.idle_fraction() before a whole step was timed")
        span = self.marks.seconds(*self._step)
        busy = sum(self.marks.seconds(a, b) for a, b in self._busy)
        return 1.0 - busy / span if span > 0 else 0.0
