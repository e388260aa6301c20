"""`wandb`: `wandb.init(project, group, entity=team)`, then `wandb.log({tag: value}, step=step)` per
event. `WANDB_MODE=offline` (wandb's own variable) keeps the run on disk, never on the network."""
from __future__ import annotations

from .master import require


class WandbMonitor:
    def __init__(self, wandb):
        library = require("wandb", "wandb.enabled", "wandb")
        self.run = library.init(project=wandb.project, group=wandb.group, entity=wandb.team)

    def write_events(self, events) -> None:
        for tag, value, step in events:
            self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()
