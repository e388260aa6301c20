"""Monitors: training scalars to TensorBoard, CSV files, Weights & Biases and Comet, with DeepSpeed
0.19's config keys, tags, file layout and x-axis, so a DeepSpeed user's dashboards carry over.

An event is DeepSpeed's `(tag, value, step)` tuple; the engine's step is global samples. Everything is
written on global rank 0 only (the other ranks build no writer). User code logs its own scalars
through the same writers with `eng.monitor.write_events([(tag, value, step)])` (DeepSpeed's call) or
`eng.log_scalars({tag: value})` (x-axis: the engine's global samples).
"""
from __future__ import annotations

from .master import MonitorMaster, build_monitors

__all__ = ["MonitorMaster", "build_monitors"]
