"""Forward / backward / step wall time of each training step, measured the same way for every system
that has DeepSpeed's calls (`loss = eng(x, y)`, `eng.backward(loss)`, `eng.step()`): dstrain and
DeepSpeed itself (benchmarks/deepspeed_peer.py imports this from its own venv, so: standard library
only). On a CPU-only machine every call returns when its work is done, so no device sync is needed; a
collective overlapped with backward is counted in backward, the step's norm, clipping, optimizer
and all-gather in step."""
from __future__ import annotations

import statistics
import time

PHASES = ("forward", "backward", "step")


def kept(times: list[float]) -> list[float]:
    """The steps a median is taken over: without the first two and the last when there are more than 4
    (allocator and cache warm-up, the last step's teardown), as deepspeed_peer.py's step_ms."""
    return times[2:-1] if len(times) > 4 else times[1:] or times


class StepPhases:
    def __init__(self):
        self.ms: dict[str, list[float]] = {name: [] for name in PHASES}

    def train_step(self, eng, x, y):
        """One micro-step through `eng`, each of its three calls timed; returns the loss."""
        t0 = time.perf_counter()
        loss = eng(x, y)
        t1 = time.perf_counter()
        eng.backward(loss)
        t2 = time.perf_counter()
        eng.step()
        t3 = time.perf_counter()
        for name, ms in zip(PHASES, ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)):
            self.ms[name].append(ms)
        return loss

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(kept(ms)) for name, ms in self.ms.items() if ms}


def fixed_batch_steps(eng, x, y, steps: int, phases: StepPhases | None = None,
                      on_step=None) -> tuple[list[float], list[float], list[float | None]]:
    """`steps` steps of `eng` on one batch (bench_infinity and its DeepSpeed peer): each step's loss,
    wall time in seconds and global gradient norm before clipping (`get_global_grad_norm()`, which both
    engines have), each phase's time into `phases` if given. A loss that falls says the updates reach
    the weights. `on_step(k)`, if given, is called after step k (a long run's progress)."""
    losses, times, norms, phases = [], [], [], phases or StepPhases()
    for k in range(steps):
        t = time.perf_counter()
        loss = phases.train_step(eng, x, y)
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        norm = eng.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        if on_step is not None:
            on_step(k)
    return losses, times, norms
