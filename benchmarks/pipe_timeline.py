"""A per-rank timeline of dstrain pipeline steps (bench_pipeline.py --timeline): the start and end of
every computation torch's stage runs, every blocking wait on a send or receive, every posting of
point-to-point ops, and the engine's phases around the schedule (pulling the batch, the batch's
agreement over the world, the schedule run, the reductions, the optimizer step with its norm agreement).

Times are `time.perf_counter` (CLOCK_MONOTONIC on Linux): one clock for every process on a machine,
so the ranks' timelines share an origin. This is a diagnostic, not the engine: it wraps the engine's
and the stages' methods on the instances and torch's module-level `_wait_batch_p2p` / `_batch_p2p`
for the steps it records, and puts them back afterwards.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from torch.distributed.pipelining import schedules as torch_schedules

_ENGINE_PHASES = ("_pull", "_batch_key", "_schedule_for", "_stage_loss", "_boundary_step")
_STAGE_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def _timed(events: list, label, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((label(args, kwargs) if callable(label) else label, t0, time.perf_counter()))
    return wrapper


@contextmanager
def recording(eng, events: list):
    """Record into `events` [(label, start, end)] what `eng` does until the block ends (module docstring).
    The stages must exist already (call after one train_batch of the same shapes)."""
    saved_engine = {name: getattr(eng, name) for name in _ENGINE_PHASES}
    for name, fn in saved_engine.items():
        setattr(eng, name, _timed(events, name.lstrip("_"), fn))
    stages = [st for entry in eng._built.values() for st in entry[0]]
    for st in stages:
        for name, kind in _STAGE_ACTIONS.items():
            setattr(st, name, _timed(events, lambda a, kw, k=kind: f"{k}{a[0]}", getattr(st, name)))
    scheds = [entry[1] for entry in eng._built.values()]
    for sched in scheds:
        sched._step_microbatches = _timed(events, "schedule", sched._step_microbatches)
        sched._maybe_compute_loss = _timed(events, lambda a, kw: f"L{a[3]}", sched._maybe_compute_loss)
    wait, post = torch_schedules._wait_batch_p2p, torch_schedules._batch_p2p
    torch_schedules._wait_batch_p2p = _timed(events, lambda a, kw: "wait" if a[0] else "wait(none)", wait)
    torch_schedules._batch_p2p = _timed(events, lambda a, kw: f"post:{kw.get('desc', '')}", post)
    opt = eng.zero_optimizer
    saved_reduce = opt.norm_reduce
    opt.norm_reduce = _timed(events, "norm_allreduce", saved_reduce)
    try:
        yield events
    finally:
        torch_schedules._wait_batch_p2p, torch_schedules._batch_p2p = wait, post
        opt.norm_reduce = saved_reduce
        for name in _ENGINE_PHASES:
            delattr(eng, name)  # back to the class's methods
        for st in stages:
            for name in _STAGE_ACTIONS:
                delattr(st, name)
        for sched in scheds:
            del sched._step_microbatches, sched._maybe_compute_loss


def summarize(per_rank: list[list[tuple]], steps: list[tuple[float, float]]) -> str:
    """The ranks' events as one table per recorded step, times in ms from the step's earliest start over
    all ranks; `steps`: per rank, the (start, end) of each recorded train_batch, [[(t0, t1), ...], ...]."""
    lines = []
    n_steps = len(steps[0])
    for k in range(n_steps):
        origin = min(s[k][0] for s in steps)
        lines.append(f"# step {k}: train_batch per rank (ms from the earliest start): "
                     + ", ".join(f"r{r} {(s[k][0] - origin) * 1e3:.1f}..{(s[k][1] - origin) * 1e3:.1f}" for r, s in enumerate(steps)))
        for r, events in enumerate(per_rank):
            t0, t1 = steps[r][k]
            inside = sorted((e for e in events if t0 <= e[1] <= t1), key=lambda e: e[1])
            cells = [f"{label} {(a - origin) * 1e3:.1f}-{(b - origin) * 1e3:.1f}" for label, a, b in inside
                     if label != "wait(none)" and not (label.startswith("post") and (b - a) < 2e-5)]
            lines.append(f"  r{r}: " + " | ".join(cells))
        lines.append(_idle_summary(per_rank, steps, k, origin))
    return "\n".join(lines)


def _idle_summary(per_rank, steps, k, origin) -> str:
    """Per rank: its own schedule span's idle share, and the idle share over the pipeline's span (the
    earliest schedule start to the latest schedule end over the ranks: the formula's quantity)."""
    spans, busy = [], []
    for r, events in enumerate(per_rank):
        t0, t1 = steps[r][k]
        sched = [e for e in events if e[0] == "schedule" and t0 <= e[1] <= t1][0]
        spans.append((sched[1], sched[2]))
        busy.append(sum(b - a for label, a, b in events if label[0] in "FBWL" and label[1:].isdigit()
                        and sched[1] <= a <= sched[2]))
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)
    own = "/".join(f"{1 - b / (s[1] - s[0]):.3f}" for b, s in zip(busy, spans))
    pipe = "/".join(f"{1 - b / (last - first):.3f}" for b in busy)
    starts = "/".join(f"{(s[0] - origin) * 1e3:.1f}" for s in spans)
    ends = "/".join(f"{(s[1] - origin) * 1e3:.1f}" for s in spans)
    return (f"  schedule start {starts} end {ends} ms; idle of own span {own}; idle of the pipeline's span {pipe} "
            "(busy = F/B/W/L calls; L: the last stage's loss)")
