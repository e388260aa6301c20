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

[Note: whose span] The formula (p−1)/(m+p−1) is the share of the *pipeline's* span — from the
earliest start of any rank's schedule run to the latest end of one — that a stage does not compute.
A rank's own schedule run is a shorter interval on every stage but the one that ends last: in 1F1B
the last stage returns once it has sent its final input gradient, while the first stage still runs
that micro-batch's backward (two thirds of a micro-batch's work). Divided by its own span, the last
stage reported less than the formula; the first stage's span is the pipeline's already
(benchmarks/pipe_timeline.py shows it). So `pipeline_idle` divides each rank's computing time by the
union of the ranks' spans, from their edges exchanged over the pipe group only when the fraction is
asked for (`PipelineEngine.measured_idle`). Edges are host `time.perf_counter` readings
(CLOCK_MONOTONIC): one clock for every process of a machine. Two machines' clocks differ by an offset
no one measured (NTP keeps them within milliseconds, a micro-batch's order), so edges from two hosts
are refused rather than compared. On CUDA the edges are host times too, while the computing time is
the events' (the note above): CUDA events measure time only between events of one device, so they
cannot place two ranks' spans on one axis. NCCL's waits order streams without blocking the host, so
a host edge can lead its stream by the work queued and not yet run: there the span is a lower bound
and the fraction may read low by up to that queued work (not measured: no accelerator here).
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
        # the span's edges on the host clock, comparable between ranks (note: whose span); on CPU the marks
        # are host readings already
        self._host = None if isinstance(self.marks, _HostMarks) else time.perf_counter
        self._step: list = []
        self._edges: tuple[float, float] | None = None
        self._busy: list[tuple] = []
        self._depth = 0
        self._start = None

    def start_step(self) -> None:
        self._busy.clear()
        self._step = [self.marks.mark()]
        self._edges = (self._step[0] if self._host is None else self._host(), None)

    def stop_step(self) -> None:
        self._step.append(self.marks.mark())
        self._edges = (self._edges[0], self._step[1] if self._host is None else self._host())

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

    def _check_step(self, what: str) -> None:
        if len(self._step) != 2:
            raise RuntimeError(f"StageClock.{what}() before a whole step was timed")

    def busy_seconds(self) -> float:
        """Time spent computing in the last step."""
        self._check_step("busy_seconds")
        return sum(self.marks.seconds(a, b) for a, b in self._busy)

    def edges(self) -> tuple[float, float]:
        """(start, end) of the last step's schedule run on the host clock (module note: whose span)."""
        self._check_step("edges")
        return self._edges

    def idle_fraction(self) -> float:
        """1 − (time computing) / (this rank's own span) of the last step (module note: whose span)."""
        self._check_step("idle_fraction")
        span = self.marks.seconds(*self._step)
        return 1.0 - self.busy_seconds() / span if span > 0 else 0.0


def pipeline_idle(ranks: list[tuple[str, tuple[float, float], float]]) -> list[float]:
    """Each rank's idle share of the pipeline's span, from every rank's (host, (start, end), busy
    seconds): 1 − busy / (latest end − earliest start) (module note: whose span)."""
    hosts = {host for host, _, _ in ranks}
    if len(hosts) > 1:
        raise RuntimeError(f"measured_idle(): the pipeline's stages run on {len(hosts)} hosts, whose clocks "
                           "are not comparable; use stage_idle_fraction() (each rank's own span) there")
    span = max(end for _, (_, end), _ in ranks) - min(start for _, (start, _), _ in ranks)
    return [1.0 - busy / span if span > 0 else 0.0 for _, _, busy in ranks]
