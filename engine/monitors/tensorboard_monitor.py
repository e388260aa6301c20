"""`tensorboard`: scalars as TensorBoard events in `SummaryWriter(<output_path>/<job_name>)`."""
from __future__ import annotations

import os

from .master import require


class TensorBoardMonitor:
    def __init__(self, tensorboard):
        require("tensorboard", "tensorboard.enabled", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(tensorboard.output_path, tensorboard.job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # DeepSpeed flushes per batch of events: a crash loses at most one step

    def close(self) -> None:
        self.writer.close()
