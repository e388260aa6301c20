"""`comet`: `comet_ml.start(...)` with the section's keys; a tag is logged when at least
`samples_log_interval` samples passed since it was last logged (DeepSpeed's rule)."""
from __future__ import annotations

from .master import require


class CometMonitor:
    def __init__(self, comet):
        comet_ml = require("comet_ml", "comet.enabled", "comet")
        experiment_config = comet_ml.ExperimentConfig(name=comet.experiment_name) if comet.experiment_name else None
        self.experiment = comet_ml.start(api_key=comet.api_key, project=comet.project,
                                         workspace=comet.workspace, experiment_key=comet.experiment_key,
                                         mode=comet.mode, online=comet.online,
                                         experiment_config=experiment_config)
        self.interval = comet.samples_log_interval
        self._last: dict[str, int] = {}

    def write_events(self, events) -> None:
        for tag, value, step in events:
            if tag in self._last and step - self._last[tag] < self.interval:
                continue
            self._last[tag] = step
            self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self.experiment.end()
